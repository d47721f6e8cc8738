"""The model-free lookahead algorithm: (N, W, G), the Jacobi window, n-gram pools, the step layout,
verification (greedy and sampling) and stop rules. Pure Python/numpy over token ids and logits."""

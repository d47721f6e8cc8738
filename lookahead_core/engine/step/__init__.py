"""One step's decisions: who runs, how wide, what was accepted; no tensors but the step's logits."""

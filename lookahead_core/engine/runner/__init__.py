"""The only owner of the model, its one copy of the weights, the KV slots and the step tensors."""

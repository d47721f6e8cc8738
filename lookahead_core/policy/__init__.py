"""The per-replica (N, W, G) policy: a measured step-cost profile and the controller that picks
each running request's setting from the queue depth."""

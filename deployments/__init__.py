"""Ray Serve application: an HTTP ingress and model replicas running the lookahead engine."""

"""Running lookahead-serve on a multi-node Ray cluster: a local cluster harness, the node-failover
and autoscaling runs (scripts whose output docs/BENCHMARKS.md quotes), and `serve deploy` by hand."""

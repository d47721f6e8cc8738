"""Loading models (folders, hub ids, GGUF files) and small random models for tests and benchmarks."""

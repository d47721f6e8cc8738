"""What a request's output may be: grammars, vLLM's logits options, and the rows shaped by both."""

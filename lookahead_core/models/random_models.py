"""Small random-weight causal LMs of several architectures, for tests and benchmarks."""
from __future__ import annotations

from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
)

ARCHITECTURES = ("llama", "mistral", "qwen2", "phi3", "gemma", "gpt2")

# Random models for benchmarks of step cost: `random:small` is a ~30M-parameter Llama.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(arch="llama"),
    "small": dict(arch="llama", vocab_size=8192, hidden=512, layers=8, heads=8, kv_heads=4, context=2048, init_std=0.05),
}


def tiny_config(
    arch: str, vocab_size: int = 512, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, context: int = 1024
):
    common: dict[str, Any] = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    decoder: dict[str, Any] = dict(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        **common,
    )
    if arch == "llama":
        return LlamaConfig(**decoder)
    if arch == "mistral":
        return MistralConfig(sliding_window=context, **decoder)
    if arch == "qwen2":
        return Qwen2Config(**decoder)
    if arch == "phi3":
        return Phi3Config(**decoder)
    if arch == "gemma":
        return GemmaConfig(head_dim=hidden // heads, **decoder)
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=context, **common)
    raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHITECTURES)}")


def build_random_model(
    arch: str, *, seed: int = 0, attn_implementation: str = "sdpa", init_std: float = 0.3, dtype=torch.float32, **config_kwargs
):
    """A random model whose greedy output is not a short loop.

    The default init (std 0.02) makes every logit nearly equal, so greedy decoding falls into a
    one- or two-token cycle at once; a wide init gives peaked, context-dependent predictions.
    """
    config = tiny_config(arch, **config_kwargs)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    # A random model has no real end token; without this, token 1 would end outputs at random.
    model.generation_config.eos_token_id = None
    return model.eval()

"""Loading a model and tokenizer from a local path, or a built-in random model."""
from __future__ import annotations

import torch

from .tiny_models import PRESETS, build_random_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}") from None


def load_model(
    path: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
):
    """Return (model, tokenizer or None). `random:PRESET` builds a random model with no tokenizer."""
    torch_dtype = resolve_dtype(dtype)
    if path.startswith("random:"):
        preset = path.split(":", 1)[1]
        if preset not in PRESETS:
            raise ValueError(f"unknown random preset {preset!r}; choose from {', '.join(PRESETS)}")
        model = build_random_model(attn_implementation=attn_implementation, dtype=torch_dtype, **PRESETS[preset])
        return model.to(device), None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
    )
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model.to(device).eval(), tokenizer

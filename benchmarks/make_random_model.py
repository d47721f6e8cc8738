"""A bigger model for memory and speed figures where no model hub is reachable: a published
model's config with random weights and the default model's tokenizer, as a save_pretrained folder
both servers load. Its text is noise; its step costs and memory are the real model's.

    python -m benchmarks.make_random_model --out .cache/models/SmolLM2-1.7B-random
    python -m benchmarks.bench_serving --model .cache/models/SmolLM2-1.7B-random --users 1,16 --max-tokens 32
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

# HuggingFaceTB/SmolLM2-1.7B-Instruct's config.json (Llama, 24 layers, no grouped-query heads)
CONFIGS: dict[str, dict] = {
    "SmolLM2-1.7B": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 8192, "initializer_range": 0.02, "max_position_embeddings": 8192,
        "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 24, "num_key_value_heads": 32,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 130000,
        "tie_word_embeddings": True, "use_cache": True, "vocab_size": 49152,
    },
}


def make(out: Path, name: str, dtype: torch.dtype, seed: int, tokenizer_from: str) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lookahead_core.models.loading import load_tokenizer, model_folder

    config = LlamaConfig(**CONFIGS[name])
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device="cpu")
    with torch.no_grad():  # the published init's scale: logits of a plausible spread, not a constant
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, config.initializer_range)
            else:
                p.fill_(1.0)
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    load_tokenizer(model_folder(tokenizer_from)).save_pretrained(out)
    (out / "random_weights.json").write_text(json.dumps({"config_of": name, "seed": seed, "dtype": str(dtype)}))
    return out


def main(argv: list[str] | None = None) -> Path:
    from lookahead_core.models.loading import DEFAULT_MODEL, DTYPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="SmolLM2-1.7B", choices=sorted(CONFIGS))
    ap.add_argument("--out", default=".cache/models/SmolLM2-1.7B-random")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-from", default=DEFAULT_MODEL, help="the model whose tokenizer the folder takes")
    args = ap.parse_args(argv)
    out = make(Path(args.out), args.config, DTYPES[args.dtype], args.seed, args.tokenizer_from)
    print(f"{args.config} with random {args.dtype} weights in {out}")
    return out


if __name__ == "__main__":
    main()

"""Complete one prompt with plain greedy decoding and with lookahead; print both speeds.

    python -m lookahead_core.cli.demo --model PATH --prompt "def fib(n):" --max-new-tokens 128 --n 4 --w 3 --g 3
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from lookahead_core.engine.generation import generate
from lookahead_core.engine.runner.model_runner import ModelRunner
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.models.loading import load_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m lookahead_core.cli.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True, help="save_pretrained folder, GGUF file or package:PKG/FILE")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--w", type=int, default=3)
    ap.add_argument("--g", type=int, default=3)
    ap.add_argument("--no-prompt-pool", action="store_true", help="do not seed the n-gram pool from the prompt")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    try:
        params = LookaheadParams(args.n, args.w, args.g, pool_from_prompt=not args.no_prompt_pool)
    except ValueError as exc:
        ap.error(str(exc))

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    if tokenizer is None:
        ap.error("--model needs a tokenizer beside the weights")
    runner = ModelRunner(model)
    ids = torch.tensor([tokenizer(args.prompt)["input_ids"]])
    if ids.shape[1] == 0:
        ap.error("the prompt tokenizes to nothing")

    def timed(p):
        t0 = time.perf_counter()
        res = generate(runner, ids, max_new_tokens=args.max_new_tokens, params=p)
        return res, time.perf_counter() - t0

    timed(params)  # warm-up
    plain, plain_s = timed(None)
    look, look_s = timed(params)
    print(args.prompt + tokenizer.decode(look.tokens))
    print("-" * 60)
    print(f"lookahead (N={params.n}, W={params.w}, G={params.g}): {len(look.tokens)} tokens in {look_s:.3f}s, "
          f"{len(look.tokens) / look_s:.1f} tok/s, compression {look.stats.compression:.2f}, finish {look.finish_reason}")
    print(f"plain greedy: {len(plain.tokens)} tokens in {plain_s:.3f}s, {len(plain.tokens) / plain_s:.1f} tok/s")
    print(f"speedup vs plain: {plain_s / look_s:.2f}x; outputs identical: {plain.tokens == look.tokens}")
    return 0 if plain.tokens == look.tokens else 1


if __name__ == "__main__":
    sys.exit(main())

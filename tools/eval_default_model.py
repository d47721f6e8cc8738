"""Quality figures of the default model for docs/MODEL.md.

    python -m tools.eval_default_model --model models/tiny-pycoder --json results/model_eval.json

- load time (from_pretrained of model and tokenizer, offline);
- held-out perplexity over every held-out file (whole files the training never saw);
- greedy completions (lookahead decoding: the same tokens as plain greedy) of the held-out
  functions in benchmarks/prompts/code.jsonl, cut at the function boundary (the first line back
  at the def's indentation) or, when the budget ends first, at the last full line: the share with
  a non-empty body that `ast.parse` accepts, and the share that reached the boundary;
- distinct-4-gram ratio of completions (unique / total token 4-grams, mean per completion),
  beside the same figure for the human-written bodies.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from lookahead_core import LookaheadParams, ModelRunner, generate
from tools.corpus import collect


def cut_at_function_boundary(completion: str) -> tuple[str, bool]:
    lines = completion.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if i > 0 and line.strip() and not line[0].isspace():
            return "".join(lines[:i]), True
    if completion.endswith("\n"):
        return completion, False
    return "".join(lines[:-1]), False


def distinct4(tokens: list[int]) -> float:
    grams = [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / len(grams) if grams else 1.0


@torch.no_grad()
def heldout_perplexity(model, tok, manifest: dict, seq: int = 512) -> tuple[float, int]:
    held = set(manifest["heldout_files"])
    files = [f for f in collect()[0] if f.key in held]
    eos = tok.eos_token_id
    nll, count = 0.0, 0
    for f in files:
        ids = tok(f.text)["input_ids"] + [eos]
        for i in range(0, len(ids) - 1, seq):
            x = torch.tensor([ids[i : i + seq + 1]])
            if x.shape[1] < 2:
                continue
            out = model(input_ids=x[:, :-1], labels=x[:, :-1])
            logits = out.logits[0]
            loss = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum")
            nll += loss.item()
            count += x.shape[1] - 1
    return math.exp(nll / count), count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-pycoder")
    ap.add_argument("--prompts", default="benchmarks/prompts/code.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    load_s = time.perf_counter() - t0
    manifest = json.loads((Path(args.model) / "corpus.json").read_text())
    ppl, ppl_tokens = heldout_perplexity(model, tok, manifest)
    print(f"load {load_s:.2f}s; held-out perplexity {ppl:.2f} over {ppl_tokens} tokens", file=sys.stderr)

    runner = ModelRunner(model)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    parsed = boundary = 0
    d4, d4_ref, samples = [], [], []
    for i, row in enumerate(rows):
        ids = tok(row["prompt"])["input_ids"]
        res = generate(runner, torch.tensor([ids]), max_new_tokens=args.max_new_tokens, params=LookaheadParams(4, 5, 5))
        text = tok.decode(res.tokens, skip_special_tokens=True)
        body, reached = cut_at_function_boundary(text)
        try:
            ast.parse(row["prompt"] + body)
            ok = any(line.strip() for line in body.splitlines())  # an empty body is no completion
        except SyntaxError:
            ok = False
        parsed += ok
        boundary += reached
        d4.append(distinct4(res.tokens))
        d4_ref.append(distinct4(tok(row["reference"])["input_ids"]))
        if i < 3:
            samples.append({"id": row["id"], "prompt": row["prompt"], "completion": body, "parses": ok})
        print(f"\r{i + 1}/{len(rows)} completions", end="", file=sys.stderr)
    print(file=sys.stderr)
    report = {
        "load_seconds": round(load_s, 2),
        "heldout_perplexity": round(ppl, 3),
        "heldout_tokens": ppl_tokens,
        "completions": len(rows),
        "ast_parse_share": round(parsed / len(rows), 3),
        "function_boundary_share": round(boundary / len(rows), 3),
        "distinct4_completions": round(sum(d4) / len(d4), 3),
        "distinct4_references": round(sum(d4_ref) / len(d4_ref), 3),
        "samples": samples,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

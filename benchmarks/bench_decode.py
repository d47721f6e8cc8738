"""Decode speed of one sequence: HF greedy `generate`, our plain path and lookahead, in one process.

Every prompt runs every configuration back to back (rotating the order), so drift in machine
speed hits all of them alike. Speedups are ratios of total time over the same prompts.

    python benchmarks/bench_decode.py --model random:small --num-prompts 8 --max-new-tokens 128
    python benchmarks/bench_decode.py --model models/NAME --prompts benchmarks/prompts/code.jsonl
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lookahead_core import LookaheadParams, ModelRunner, SamplingParams, generate
from lookahead_core.loading import load_model


@dataclass
class Config:
    name: str
    kind: str  # "hf" | "plain" | "lookahead"
    params: LookaheadParams | None = None


@dataclass
class Tally:
    seconds: list[float] = field(default_factory=list)
    tokens: int = 0
    steps: int = 0
    forward_s: float = 0.0
    decode_s: float = 0.0
    exact: int = 0
    runs: int = 0
    distinct4: list[float] = field(default_factory=list)


def parse_configs(spec: str, pool: str) -> list[Config]:
    configs = [Config("hf-greedy", "hf"), Config("plain", "plain")]
    pools = {"on": [True], "off": [False], "both": [True, False]}[pool]
    for item in spec.split(";"):
        if not item.strip():
            continue
        n, w, g = (int(x) for x in item.split(","))
        for from_prompt in pools:
            suffix = "" if len(pools) == 1 else ("+prompt" if from_prompt else "-prompt")
            configs.append(Config(f"la({n},{w},{g}){suffix}", "lookahead", LookaheadParams(n, w, g, from_prompt)))
    return configs


def load_prompts(path: str | None, tokenizer, count: int, vocab: int, length: int, seed: int) -> list[list[int]]:
    if path is None:
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(2, vocab, (length,), generator=gen).tolist() for _ in range(count)]
    prompts = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "input_ids" in row:
            prompts.append([int(t) for t in row["input_ids"]])
        elif tokenizer is None:
            sys.exit(f"{path} holds text prompts but the model has no tokenizer")
        else:
            prompts.append(tokenizer(row["prompt"])["input_ids"])
        if len(prompts) == count:
            break
    return prompts


def run_hf(model, prompt: list[int], max_new: int, sampling: SamplingParams | None = None) -> tuple[list[int], float]:
    ids = torch.tensor([prompt], device=model.device)
    kw = {"do_sample": False}
    if sampling is not None:
        kw = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k or None, "top_p": sampling.top_p}
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, pad_token_id=0, **kw)
    return out[0, len(prompt) :].tolist(), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:small", help="model path, or random:PRESET")
    ap.add_argument("--prompts", default=None, help="JSONL with `prompt` or `input_ids`; random prompts if absent")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64, help="length of random prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--configs", default="3,4,4;4,5,5;5,7,7", help="semicolon-separated N,W,G")
    ap.add_argument("--pool", choices=["on", "off", "both"], default="on", help="n-grams from prompt and output")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sample (HF do_sample) instead of greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    vocab = model.config.get_text_config().vocab_size
    prompts = load_prompts(args.prompts, tokenizer, args.num_prompts, vocab, args.prompt_len, seed=0)
    configs = parse_configs(args.configs, args.pool)
    runner = ModelRunner(model)
    tallies = {c.name: Tally() for c in configs}
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p) if args.temperature > 0 else None
    if sampling is not None:
        configs[0].name = "hf-sample"
        tallies = {c.name: Tally() for c in configs}

    tally_seeds: list[int] = []

    def run(config: Config, prompt: list[int], hf_tokens: list[int] | None) -> list[int]:
        if config.kind == "hf":
            tokens, seconds = run_hf(model, prompt, args.max_new_tokens, sampling)
            steps, fwd, dec = len(tokens), 0.0, 0.0
        else:
            t0 = time.perf_counter()
            seeded = None if sampling is None else SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=len(tally_seeds))
            tally_seeds.append(1)
            res = generate(runner, torch.tensor([prompt]), max_new_tokens=args.max_new_tokens, params=config.params, sampling=seeded)
            seconds = time.perf_counter() - t0
            tokens, steps, fwd, dec = res.tokens, res.stats.steps, res.stats.forward_s, res.stats.decode_s
        tally = tallies[config.name]
        tally.seconds.append(seconds)
        tally.tokens += len(tokens)
        tally.steps += steps
        tally.forward_s += fwd
        tally.decode_s += dec
        tally.runs += 1
        tally.exact += hf_tokens is None or sampling is not None or tokens == hf_tokens
        grams = [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]
        tally.distinct4.append(len(set(grams)) / len(grams) if grams else 1.0)
        return tokens

    for config in configs:  # warm-up: first-call costs out of the figures
        run(config, prompts[0], None)
    for t in tallies.values():
        t.__init__()

    total = len(prompts) * len(configs)
    done = 0
    t_start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        hf_tokens = run(configs[0], prompt, None)
        rest = configs[1:]
        k = i % len(rest)
        for config in rest[k:] + rest[:k]:
            run(config, prompt, hf_tokens)
        done += len(configs)
        elapsed = time.perf_counter() - t_start
        print(f"\r[{done}/{total}] {elapsed:.0f}s elapsed, ~{elapsed / done * (total - done):.0f}s left", end="", file=sys.stderr)
    print(file=sys.stderr)

    hf = tallies[configs[0].name]
    hf_rate = hf.tokens / sum(hf.seconds)
    rows = []
    for config in configs:
        t = tallies[config.name]
        rows.append(
            {
                "config": config.name,
                "median_s": statistics.median(t.seconds),
                "tokens_per_s": t.tokens / sum(t.seconds),
                "compression": t.tokens / t.steps if t.steps else 0.0,
                # tokens/s ratio: equal to the time ratio for greedy, fair when sampled lengths differ
                "speedup_vs_hf": (t.tokens / sum(t.seconds)) / hf_rate,
                "host_overhead": (1 - t.forward_s / t.decode_s) if t.decode_s else None,
                "exact": f"{t.exact}/{t.runs}" if sampling is None else "n/a",
                # how repetitive the decoded text is: loops make n-gram hits cheap
                "distinct4": statistics.mean(t.distinct4),
            }
        )
    header = f"{'config':<22}{'median s':>10}{'tok/s':>9}{'compr.':>8}{'vs HF':>8}{'host ovh':>10}{'exact':>8}{'dist-4':>8}"
    mode = "greedy" if sampling is None else f"sampling T={sampling.temperature} top_k={sampling.top_k} top_p={sampling.top_p}"
    print(f"model={args.model} prompts={len(prompts)} max_new_tokens={args.max_new_tokens} threads={torch.get_num_threads()} {mode}")
    print(header)
    for r in rows:
        ovh = "-" if r["host_overhead"] is None else f"{100 * r['host_overhead']:.1f}%"
        print(
            f"{r['config']:<22}{r['median_s']:>10.3f}{r['tokens_per_s']:>9.1f}{r['compression']:>8.2f}"
            f"{r['speedup_vs_hf']:>7.2f}x{ovh:>10}{r['exact']:>8}{r['distinct4']:>8.2f}"
        )
    report = {
        "args": vars(args),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "rows": rows,
        "configs": [asdict(c) for c in configs],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()

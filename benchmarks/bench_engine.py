"""Engine throughput and latency against concurrency, all in one run.

    python -m benchmarks.bench_engine --prompts benchmarks/prompts/chat.jsonl --chat --concurrency 1,4,16
    python -m benchmarks.bench_engine --model FOLDER --device cuda --engine-compile off,on --compile-buckets 1x1,16x16


Closed loop: `c` requests in flight, a new one as soon as one finishes. Rows: the engine with
plain batched decoding and with fixed (N, W, G); HF `generate` on left-padded batches of `c`
prompts (outside baseline); at c = 1 also single-sequence `lookahead_core.generate`. EOS is
ignored so every request yields exactly --max-new-tokens tokens and throughputs compare like for like.
With `--engine-compile off,on` each engine row runs eagerly and in compiled buckets (CUDA graphs on
CUDA), same prompts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch

from benchmarks.bench_decode import load_prompts
from lookahead_core import LookaheadParams, ModelRunner, generate
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.io import EngineRequest
from lookahead_core.lookahead.stopping import StopCondition
from lookahead_core.models.loading import DEFAULT_MODEL, load_model


def run_engine(engine: Engine, prompts, concurrency: int, requests: int, max_new: int, params,
               eos: int | list[int] | None = None) -> dict:
    """`requests` of `prompts` (token ids, cycled), `concurrency` in flight; each stops at
    `max_new` tokens, or at `eos` where given."""
    engine.knowledge.clear()  # every run starts cold: no run decodes text an earlier one saw, nor its rates
    pending = deque(range(requests))
    added, latencies, tokens, inflight = {}, [], 0, 0
    t0 = time.perf_counter()
    while pending or engine.has_work():
        while pending and inflight < concurrency:
            i = pending.popleft()
            engine.add_request(EngineRequest(i, tuple(prompts[i % len(prompts)]), StopCondition.build(max_new, eos),
                                             params if params is not None else "off"))
            added[i] = time.perf_counter()
            inflight += 1
        for out in engine.step():
            tokens += len(out.tokens)
            if out.finish_reason is not None:
                latencies.append(time.perf_counter() - added[out.seq_id])
                inflight -= 1
    wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens / wall, "p50_latency_s": statistics.median(latencies), "tokens": tokens}


def run_hf_batches(model, prompts, concurrency: int, requests: int, max_new: int, pad_id: int) -> dict:
    tokens, latencies = 0, []
    t0 = time.perf_counter()
    for b in range(0, requests, concurrency):
        batch = [prompts[i % len(prompts)] for i in range(b, min(b + concurrency, requests))]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        ts = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
            pad_token_id=pad_id, eos_token_id=None,
        )
        latencies += [time.perf_counter() - ts] * len(batch)
        tokens += (out.shape[1] - width) * len(batch)
    wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens / wall, "p50_latency_s": statistics.median(latencies), "tokens": tokens}


def run_single(runner, prompts, requests: int, max_new: int, params) -> dict:
    tokens, latencies = 0, []
    t0 = time.perf_counter()
    for i in range(requests):
        ts = time.perf_counter()
        res = generate(runner, torch.tensor([prompts[i % len(prompts)]]), max_new_tokens=max_new, params=params, eos_token_id=[])
        latencies.append(time.perf_counter() - ts)
        tokens += len(res.tokens)
    wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens / wall, "p50_latency_s": statistics.median(latencies), "tokens": tokens}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--chat", action="store_true", help="send each prompt as a user turn through the chat template")
    ap.add_argument("--prompts", default="benchmarks/prompts/code.jsonl")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--requests-per-level", type=int, default=2, help="requests = this x concurrency (at least --min-requests)")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--configs", default="4,5,5;3,4,4", help="semicolon-separated N,W,G for the engine")
    ap.add_argument("--prompt-len", type=int, default=64, help="random prompts when --prompts is empty")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engine-compile", default="off", help="off | on | off,on: the engine eager, compiled, or both")
    ap.add_argument("--compile-buckets", default="1x1,1x16,16x1,16x16",
                    help="CUDA: the BATCHxWIDTH,... shapes captured as CUDA graphs with --engine-compile on (on CPU one "
                         "graph takes every shape)")
    ap.add_argument("--compile-kv", default="", help="CUDA: key lengths of the CUDA graphs (empty: the KV capacity)")
    ap.add_argument("--compile-dir", default=None, help="where the engine keeps its compiled graphs (default: inductor's cache)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    vocab = model.config.get_text_config().vocab_size
    levels = [int(c) for c in args.concurrency.split(",")]
    most = max(max(args.min_requests, args.requests_per_level * c) for c in levels)
    prompts = load_prompts(args.prompts or None, tokenizer, most, vocab, args.prompt_len, args.chat)
    if len(prompts) < most:  # a repeated prompt would find its own earlier output in the shared pool
        sys.exit(f"{args.prompts} holds {len(prompts)} prompts; the largest level needs {most} distinct ones")
    lookahead = [LookaheadParams.parse(item) for item in args.configs.split(";") if item.strip()]
    runner = ModelRunner(model)  # the single-request rows': an engine's runner holds that engine's KV
    base = dict(max_batch=max(levels), max_new_tokens=args.max_new_tokens, prefill_chunk=256)
    engines, compile_s = {}, None
    for mode in args.engine_compile.split(","):
        if mode == "off":
            engines[""] = Engine(ModelRunner(model), EngineConfig(**base))
            continue
        shapes: dict = {"compile_dir": args.compile_dir}
        if args.device != "cpu":
            shapes.update(compile_buckets=[tuple(int(x) for x in b.split("x")) for b in args.compile_buckets.split(",")],
                          compile_kv=tuple(int(k) for k in args.compile_kv.split(",") if k))
        t0 = time.perf_counter()
        engines[" compiled"] = Engine(ModelRunner(model), EngineConfig(**base, compile="on", **shapes))
        compile_s = time.perf_counter() - t0
    pad_id = model.generation_config.pad_token_id or 0

    rows: dict[str, dict[int, dict]] = {}
    plans: list[tuple[str, LookaheadParams | None, str, Engine | None]] = [("hf-generate (padded batch)", None, "hf", None)]
    for tag, engine in engines.items():
        plans += [(f"engine plain{tag}", None, "engine", engine)]
        plans += [(f"engine la({p.n},{p.w},{p.g}){tag}", p, "engine", engine) for p in lookahead]
    plans += [("single generate plain", None, "single", None)]
    plans += [(f"single generate la({p.n},{p.w},{p.g})", p, "single", None) for p in lookahead]
    for engine in engines.values():  # warm-up
        run_engine(engine, prompts, 2, 2, min(8, args.max_new_tokens), lookahead[0] if lookahead else None)
    total = sum(len(levels) if kind != "single" else 1 for _, _, kind, _ in plans)
    done, t_start = 0, time.perf_counter()
    for c in levels:
        requests = max(args.min_requests, args.requests_per_level * c)  # <= most: no prompt repeats
        for name, params, kind, engine in plans:
            if kind == "single" and c != 1:
                continue
            if kind == "hf":
                fig = run_hf_batches(model, prompts, c, requests, args.max_new_tokens, pad_id)
            elif engine is not None:
                fig = run_engine(engine, prompts, c, requests, args.max_new_tokens, params)
            else:
                fig = run_single(runner, prompts, requests, args.max_new_tokens, params)
            rows.setdefault(name, {})[c] = fig
            done += 1
            el = time.perf_counter() - t_start
            print(f"\r[{done}/{total}] {el:.0f}s, ETA {el / done * (total - done):.0f}s", end="", file=sys.stderr)
    print(file=sys.stderr)

    device = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else f"cpu {torch.backends.cpu.get_cpu_capability()}"
    dtype = str(model.dtype).removeprefix("torch.")
    print(f"model={args.model} dtype={dtype} device={device} max_new_tokens={args.max_new_tokens} threads={torch.get_num_threads()}")
    for tag, engine in engines.items():
        if engine.runner.graphs is not None:
            print(f"engine{tag}: buckets compiled in {compile_s:.1f}s (not in the figures); "
                  f"{engine.runner.eager_forwards} decode forwards ran eagerly (outside every bucket)")
    head = "".join(f"{'c=' + str(c):>10}" for c in levels)
    for metric, label in (("tokens_per_s", "throughput, tokens/s"), ("p50_latency_s", "p50 request latency, s")):
        print(f"\n{label}\n{'':<34}{head}")
        for name, by_c in rows.items():
            cells = "".join(f"{by_c[c][metric]:>10.2f}" if c in by_c else f"{'':>10}" for c in levels)
            print(f"{name:<34}{cells}")
    for tag in (t for t in engines if t):
        for name in [n for n in rows if n.endswith(tag)]:
            eager = rows.get(name.removesuffix(tag))
            if eager is not None:
                ratios = ", ".join(f"c={c} {rows[name][c]['tokens_per_s'] / eager[c]['tokens_per_s']:.2f}x" for c in levels)
                print(f"{name} / eager: {ratios}")
    plain = rows["engine plain"] if "engine plain" in rows else rows["engine plain compiled"]
    summary = {"plain_c16_over_c1": plain[16]["tokens_per_s"] / plain[1]["tokens_per_s"] if 16 in plain and 1 in plain else None}
    for p in lookahead:
        key = f"la({p.n},{p.w},{p.g})"
        single = rows[f"single generate {key}"][1]["tokens_per_s"] / rows["single generate plain"][1]["tokens_per_s"]
        ekey = f"engine {key}" if f"engine {key}" in rows else f"engine {key} compiled"
        eng = rows[ekey][1]["tokens_per_s"] / plain[1]["tokens_per_s"]
        hf1 = rows["hf-generate (padded batch)"][1]["tokens_per_s"]
        summary[key] = {
            "single_speedup_vs_hf": rows[f"single generate {key}"][1]["tokens_per_s"] / hf1,
            "engine_c1_speedup_vs_hf": rows[ekey][1]["tokens_per_s"] / hf1,
            "single_speedup_vs_plain": single,
            "engine_c1_speedup_vs_plain": eng,
        }
        summary[key]["engine_keeps_share_of_single_speedup"] = (
            summary[key]["engine_c1_speedup_vs_hf"] / summary[key]["single_speedup_vs_hf"]
        )
    print("\n" + json.dumps(summary, indent=1))
    report = {"args": vars(args), "device": device, "dtype": dtype, "compile_s": compile_s,
              "rows": {k: {str(c): v for c, v in by.items()} for k, by in rows.items()}, "summary": summary}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

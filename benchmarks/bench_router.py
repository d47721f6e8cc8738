"""Real open-loop benchmark of the router policies against the engine, all in one run.

    python -m benchmarks.bench_router --model models/tiny-pycoder --profile configs/profiles/tiny-pycoder-cpu.yaml \\
        --png docs/img/router_open_loop.png --json results/bench_router.json

Poisson arrivals (the same seeded schedule for every policy) at rates from near-idle to overload.
Latency runs from each request's scheduled arrival, so queueing counts. Goodput = tokens per
second of the requests that met the TPOT SLO. Policies: plain, each fixed setting, goodput.
Each level offers load for at least --min-arrival-s seconds (so overload reaches a steady queue
rather than measuring ramp-up and drain), and every policy replays the schedule --rounds times,
in alternating order, so that drift in the machine's speed falls on all policies alike. Every run
starts from an empty shared n-gram pool and no request of a level repeats a prompt, so no policy
decodes text the replica has already seen.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks.bench_decode import load_prompts
from benchmarks.router_common import plot, policies, summarize
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.model_runner import ModelRunner
from lookahead_core.models.loading import load_model
from lookahead_core.policy.auto import AutoLookahead
from lookahead_core.policy.controller import LookaheadPolicy
from lookahead_core.policy.cost_profile import StepCostProfile


def open_loop(engine: Engine, auto: AutoLookahead, prompts, arrivals: list[float], max_new: int) -> tuple:
    n = len(arrivals)
    if engine.shared_pool is not None:
        engine.shared_pool.clear()
    first, done, produced = {}, {}, {}
    nxt = 0
    t0 = time.perf_counter()
    while len(done) < n:
        now = time.perf_counter() - t0
        while nxt < n and arrivals[nxt] <= now:
            engine.add_request(nxt, prompts[nxt], max_new_tokens=max_new, params=auto.register(nxt), eos_token_id=[])
            nxt += 1
        if not engine.has_work():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        auto.before_step(engine)
        outs = engine.step()
        now = time.perf_counter() - t0
        for out in outs:
            if out.tokens and out.seq_id not in first:
                first[out.seq_id] = now
            produced[out.seq_id] = produced.get(out.seq_id, 0) + len(out.tokens)
            if out.finish_reason is not None:
                done[out.seq_id] = now
                auto.forget(out.seq_id)
    lat = [done[i] - arrivals[i] for i in range(n)]
    ttft = [first[i] - arrivals[i] for i in range(n)]
    tpot = [(done[i] - first[i]) / max(1, produced[i] - 1) for i in range(n)]
    return lat, ttft, tpot, [produced[i] for i in range(n)], max(done.values()) - arrivals[0]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-pycoder")
    ap.add_argument("--profile", default="configs/profiles/tiny-pycoder-cpu.yaml")
    ap.add_argument("--prompts", default="benchmarks/prompts/code.jsonl")
    ap.add_argument("--rates", default=None, help="requests/s, comma-separated, lowest first; default: 2.5%%, 10%%, 50%% "
                    "and 150%% of plain decoding's capacity predicted by the profile")
    ap.add_argument("--requests", type=int, default=32, help="requests per level, at least")
    ap.add_argument("--min-arrival-s", type=float, default=4.0, help="each level's arrivals span at least this long")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--fixed", default="3,4,4;4,5,5")
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--png", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default=None, help="default: the dtype the profile was measured in")
    args = ap.parse_args(argv)

    profile = StepCostProfile.load(args.profile)
    model, tok = load_model(args.model, dtype=args.dtype or profile.dtype)
    engine = Engine(ModelRunner(model), EngineConfig(max_batch=args.max_batch, max_new_tokens=args.max_new_tokens, prefill_chunk=256))
    capacity = args.max_batch / (profile.step_ms(args.max_batch, 1) / 1000 * args.max_new_tokens)
    rates = [float(r) for r in args.rates.split(",")] if args.rates else [round(capacity * f, 2) for f in (0.025, 0.1, 0.5, 1.5)]
    per_level = [max(args.requests, math.ceil(rate * args.min_arrival_s)) for rate in rates]
    prompts = load_prompts(args.prompts or None, tok, max(per_level), model.config.vocab_size, 64)
    if len(prompts) < max(per_level):
        sys.exit(f"{args.prompts} holds {len(prompts)} prompts; the levels need {max(per_level)} distinct ones "
                 "(fewer --requests, a shorter --min-arrival-s, or --prompts '' for random ones)")
    fixed = [s for s in args.fixed.split(";") if s.strip()]
    configs = policies(args.profile, profile, args.max_batch, fixed, args.slo_tpot_ms)

    results: dict[str, dict[float, dict]] = {}
    total, count, start = len(configs) * len(rates) * args.rounds, 0, time.perf_counter()
    for cfg in configs.values():  # first use of each step shape pays one-time costs; not in the figures
        open_loop(engine, AutoLookahead(LookaheadPolicy(cfg, profile=profile)), prompts, [0.0, 0.0], min(8, args.max_new_tokens))
    for rate, n_requests in zip(rates, per_level):
        rng = random.Random(args.seed)
        arrivals, t = [], 0.0
        for _ in range(n_requests):
            arrivals.append(t)
            t += rng.expovariate(rate)
        runs: dict[str, list] = {name: [] for name in configs}
        for rnd in range(args.rounds):
            for name in list(configs)[:: 1 if rnd % 2 == 0 else -1]:
                auto = AutoLookahead(LookaheadPolicy(configs[name], profile=profile))
                runs[name].append((open_loop(engine, auto, prompts, arrivals, args.max_new_tokens), auto.choices))
                count += 1
                el = time.perf_counter() - start
                print(f"\r[{count}/{total}] {el:.0f}s, ETA {el / count * (total - count):.0f}s", end="", file=sys.stderr)
        for name, done in runs.items():
            lat, ttft, tpot, sizes = ([x for (out, _) in done for x in out[k]] for k in range(4))
            r = summarize(lat, ttft, tpot, sum(sizes), sum(out[4] for out, _ in done), None, args.slo_tpot_ms, sizes)
            choices = sum((Counter(c) for _, c in done), Counter())
            r["choices"] = {k: round(v / sum(choices.values()), 3) for k, v in sorted(choices.items())}
            results.setdefault(name, {})[rate] = r
    print(file=sys.stderr)

    print(f"model={args.model} rounds={args.rounds} max_new_tokens={args.max_new_tokens} max_batch={args.max_batch} "
          f"SLO tpot<={args.slo_tpot_ms}ms; rates (req/s) = {rates}")
    print(f"{'policy':<16}{'rate':>7}{'reqs':>6}{'p50 s':>8}{'p95 s':>8}{'ttft50':>8}{'tok/s':>8}{'goodput':>9}{'SLO ok':>8}  choices")
    for name, by_rate in results.items():
        for rate, r in by_rate.items():
            print(f"{name:<16}{rate:>7.2f}{r['requests']:>6}{r['p50_latency_s']:>8.2f}{r['p95_latency_s']:>8.2f}{r['p50_ttft_s']:>8.2f}"
                  f"{r['throughput_tok_s']:>8.0f}{r['goodput_tok_s']:>9.0f}{r['slo_attainment']:>8.0%}  {r['choices']}")
    g, p = results["goodput"], results["plain"]
    fixed_names = [k for k in results if k.startswith("fixed")]

    def ratio(a: float, b: float) -> float | None:  # None where the baseline met no SLO at all
        return a / b if b > 0 else None

    checks = {
        "low_load_p50_vs_plain": g[rates[0]]["p50_latency_s"] / p[rates[0]]["p50_latency_s"],
        "p50_vs_plain": {str(rate): g[rate]["p50_latency_s"] / p[rate]["p50_latency_s"] for rate in rates},
        "high_load_throughput_vs_plain": g[rates[-1]]["throughput_tok_s"] / p[rates[-1]]["throughput_tok_s"],
        "goodput_vs_best_fixed_or_plain": {
            str(rate): ratio(g[rate]["goodput_tok_s"], max(results[k][rate]["goodput_tok_s"] for k in fixed_names + ["plain"]))
            for rate in rates
        },
    }
    print(json.dumps(checks, indent=1))
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        plot(results, rates, args.png, f"open-loop router benchmark, {Path(args.model).name}, max_batch={args.max_batch}")
    report = {"args": vars(args), "rates": rates, "results": {k: {str(r): v for r, v in by.items()} for k, by in results.items()}, "checks": checks}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

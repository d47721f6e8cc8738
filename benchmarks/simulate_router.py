"""Discrete-event simulation of the router policies on a measured step-cost profile.

    python -m benchmarks.simulate_router --profile configs/profiles/tiny-pycoder-cpu.yaml --png docs/img/router_sim.png

Poisson arrivals at several rates; one engine with `--max-batch` slots; each step costs the
profile's latency for (running batch, padded row width of the chosen setting) plus, when a request
is admitted, its prefill; each running request gains the setting's measured compression in tokens.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from benchmarks.router_common import plot, policies, summarize
from lookahead_core.policy.controller import LookaheadPolicy
from lookahead_core.policy.cost_profile import StepCostProfile


def simulate(router: LookaheadPolicy, profile: StepCostProfile, rate: float, requests: int, out_tokens: int, prompt_tokens: int, max_batch: int, seed: int) -> dict:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(rate)
        arrivals.append(t)
    by_label = {s.label: s for s in profile.settings}
    now, nxt = 0.0, 0
    waiting, running = [], []  # running: [index, produced tokens]
    first, done = {}, {}
    while len(done) < requests:
        while nxt < requests and arrivals[nxt] <= now:
            waiting.append(nxt)
            nxt += 1
        if not running and not waiting:
            now = arrivals[nxt]
            continue
        params = router.choose(len(running) + len(waiting))
        setting = by_label["plain" if params is None else f"({params.n},{params.w},{params.g})"]
        cost = 0.0
        if waiting and len(running) < max_batch:
            i = waiting.pop(0)
            cost += profile.step_ms(1, min(prompt_tokens, max(profile.tokens))) * max(1, prompt_tokens / max(profile.tokens))
            running.append([i, 0.0])
        if running:
            cost += router.step_ms(setting, len(running))
        now += cost / 1000
        for r in running:
            if r[1] == 0:
                first[r[0]] = now
            r[1] += setting.compression
        for r in [r for r in running if r[1] >= out_tokens]:
            done[r[0]] = now
            running.remove(r)
    lat = [done[i] - arrivals[i] for i in range(requests)]
    ttft = [first[i] - arrivals[i] for i in range(requests)]
    tpot = [(done[i] - first[i]) / max(1, out_tokens - 1) for i in range(requests)]
    makespan = max(done.values()) - arrivals[0]
    return lat, ttft, tpot, requests * out_tokens, makespan


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="configs/profiles/tiny-pycoder-cpu.yaml")
    ap.add_argument("--rates", default=None, help="requests/s, comma-separated; default: 10%%..150%% of plain capacity")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--fixed", default="3,4,4;4,5,5;5,7,7")
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--slo-e2e-ms", type=float, default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    profile = StepCostProfile.load(args.profile)
    fixed = [s for s in args.fixed.split(";") if s.strip() and any(x.label == "(" + s + ")" for x in profile.settings)]
    plain_capacity = args.max_batch / (profile.step_ms(args.max_batch, 1) / 1000 * args.out_tokens)
    rates = [float(r) for r in args.rates.split(",")] if args.rates else [round(plain_capacity * f, 3) for f in (0.1, 0.3, 0.6, 0.9, 1.2, 1.5)]
    results: dict[str, dict[float, dict]] = {}
    for name, cfg in policies(args.profile, profile, args.max_batch, fixed, args.slo_tpot_ms).items():
        for rate in rates:
            router = LookaheadPolicy(cfg, profile=profile)
            lat, ttft, tpot, tokens, makespan = simulate(router, profile, rate, args.requests, args.out_tokens, args.prompt_tokens, args.max_batch, args.seed)
            results.setdefault(name, {})[rate] = summarize(lat, ttft, tpot, tokens, makespan, args.slo_e2e_ms, args.slo_tpot_ms, [args.out_tokens] * len(lat))
    print(f"profile={args.profile} max_batch={args.max_batch} out_tokens={args.out_tokens} plain capacity ~{plain_capacity:.2f} req/s")
    print(f"{'policy':<16}{'rate':>8}{'p50 s':>9}{'p95 s':>9}{'tok/s':>9}{'goodput':>9}{'SLO ok':>8}")
    for name, by_rate in results.items():
        for rate, r in by_rate.items():
            print(f"{name:<16}{rate:>8.2f}{r['p50_latency_s']:>9.2f}{r['p95_latency_s']:>9.2f}{r['throughput_tok_s']:>9.0f}"
                  f"{r['goodput_tok_s']:>9.0f}{r['slo_attainment']:>8.0%}")
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        plot(results, rates, args.png, f"simulated router policies on {Path(args.profile).name}")
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): {str(r): v for r, v in by.items()} for k, by in results.items()}, indent=1))
    return results


if __name__ == "__main__":
    main()

"""`lookahead: "auto"` against `"off"` over HTTP, closed loop, A B B A at each user count, one run.

Against a running server (`serve run serve_config.yaml`): at each user count, four phases
(auto, off, off, auto) of `--duration` seconds each; every user sends its next chat request
(`/generate` with `messages`, streamed) as soon as the last one returns, cycling through the same
prompts in every phase. A phase's throughput is the completion tokens of its requests over the time
from its start until its last request returns; latency is each request's end-to-end time, TTFT and
TPOT (time per output token after the first) are read from the stream.

    python -m benchmarks.bench_http --users 1,4,8,16,24 --duration 60 --json results/http.json
    python -m benchmarks.bench_http --users 4 --temperature 1.0 --duration 60
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import requests

from loadtests.client import ClosedLoop, percentiles, prompt_cycle, read_prompts

MODES = ("auto", "off", "off", "auto")


def phase(url: str, mode: str, users: int, duration: float, prompts: list[str], max_new_tokens: int,
          temperature: float) -> dict:
    """One closed-loop phase; returns its tokens/s, latencies and compression."""
    body = prompt_cycle(prompts, chat=True, max_new_tokens=max_new_tokens, lookahead=mode, temperature=temperature)
    start = time.time()
    outcomes = ClosedLoop(url, users, body).run(duration)
    wall = max(o.end for o in outcomes) - start if outcomes else duration
    done = [o for o in outcomes if o.ok]
    errors = [o.error for o in outcomes if not o.ok]  # counted and reported, never hidden
    tokens = sum(o.summary["usage"]["completion_tokens"] for o in done)
    comps = [o.summary["lookahead"]["compression"] for o in done if o.summary["lookahead"]["compression"] is not None]
    lat, ttft, tpot = (percentiles([getattr(o, f) for o in done], (50, 95)) for f in ("latency", "ttft", "tpot"))
    return {
        "mode": mode, "users": users, "requests": len(done), "errors": len(errors), "error_samples": errors[:3],
        "wall_s": round(wall, 2), "tokens": tokens, "tokens_per_s": round(tokens / wall, 3),
        "p50_s": lat["p50"], "p95_s": lat["p95"], "ttft_p50_s": ttft["p50"], "tpot_p50_s": tpot["p50"],
        "compression": round(statistics.mean(comps), 3) if comps else None,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--users", default="1,4,8,16,24")
    ap.add_argument("--duration", type=float, default=60, help="seconds per phase (four phases per user count)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", default="benchmarks/prompts/chat.jsonl")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    health = requests.get(args.url + "/health", timeout=30).json()
    prompts = read_prompts(args.prompts, args.num_prompts)
    levels = []
    print(f"model={health.get('model')} dtype={health.get('dtype')} cpu_capability={health.get('cpu_capability')} "
          f"torch_threads={health.get('torch_threads')} kv_slots={health.get('kv_cache', {}).get('slots')} "
          f"max_new_tokens={args.max_new_tokens} temperature={args.temperature} {args.duration:.0f} s per phase, A B B A")
    print(f"replica RSS before: {health['replica']['rss_mb']} MB")
    print(f"{'users':>5} {'auto tok/s':>11} {'off tok/s':>10} {'ratio':>6} {'auto p50':>9} {'off p50':>8} {'ratio':>6} "
          f"{'TTFT auto/off ms':>17} {'TPOT auto/off ms':>17} {'auto compr':>10} {'errors':>6}")
    for users in [int(u) for u in args.users.split(",")]:
        phases = [phase(args.url, mode, users, args.duration, prompts, args.max_new_tokens, args.temperature) for mode in MODES]
        agg = {}
        for mode in ("auto", "off"):
            mine = [p for p in phases if p["mode"] == mode]
            wall, tokens = sum(p["wall_s"] for p in mine), sum(p["tokens"] for p in mine)
            agg[mode] = {"tokens_per_s": tokens / wall if wall else 0.0,
                         **{k: statistics.fmean([p[k] for p in mine if p[k] is not None] or [float("nan")])
                            for k in ("p50_s", "ttft_p50_s", "tpot_p50_s")},
                         "compression": statistics.mean(p["compression"] or 1.0 for p in mine)}
        level = {"users": users, "phases": phases,
                 "throughput_ratio": round(agg["auto"]["tokens_per_s"] / agg["off"]["tokens_per_s"], 3),
                 "p50_ratio": round(agg["auto"]["p50_s"] / agg["off"]["p50_s"], 3),
                 "auto": agg["auto"], "off": agg["off"], "errors": sum(p["errors"] for p in phases)}
        levels.append(level)
        a, o = agg["auto"], agg["off"]
        print(f"{users:>5} {a['tokens_per_s']:>11.2f} {o['tokens_per_s']:>10.2f} {level['throughput_ratio']:>5.2f}x "
              f"{a['p50_s']:>8.2f}s {o['p50_s']:>7.2f}s {level['p50_ratio']:>5.2f}x "
              f"{1e3 * a['ttft_p50_s']:>8.0f}/{1e3 * o['ttft_p50_s']:<8.0f} {1e3 * a['tpot_p50_s']:>8.1f}/{1e3 * o['tpot_p50_s']:<8.1f} "
              f"{a['compression']:>10.2f} {level['errors']:>6}",
              flush=True)
        for sample in {e for p in phases for e in p["error_samples"]}:
            print(f"      error: {sample}")
    after = requests.get(args.url + "/health", timeout=30).json()
    print(f"replica RSS after: {after['replica']['rss_mb']} MB (same pid: {after['replica']['pid'] == health['replica']['pid']}); "
          f"step costs ms: {after.get('step_costs_ms')}")
    report = {"args": vars(args), "health_before": health, "health_after": after, "levels": levels}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

"""`lookahead: "auto"` against `"off"` over HTTP, closed loop, A B B A at each user count, one run.

Against a running server (`serve run serve_config.yaml`): at each user count, four phases
(auto, off, off, auto) of `--duration` seconds each; every user sends its next chat request
(`/generate` with `messages`) as soon as the last one returns, cycling through the same prompts
in every phase. A phase's throughput is the completion tokens of its requests over the time from
its start until its last request returns; latency is each request's end-to-end time.

    python -m benchmarks.bench_http --users 1,4,8,16,24 --duration 60 --json results/http.json
    python -m benchmarks.bench_http --users 4 --temperature 1.0 --duration 60
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import requests

MODES = ("auto", "off", "off", "auto")


def read_prompts(path: str, count: int) -> list[str]:
    lines = [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]
    step = max(len(lines) // count, 1)
    return lines[::step][:count]


def phase(url: str, mode: str, users: int, duration: float, prompts: list[str], body: dict) -> dict:
    """One closed-loop phase; returns its tokens/s, latencies and compression."""
    done: list[tuple[float, int, float | None]] = []  # (latency s, tokens, compression)
    errors: list[str] = []
    lock = threading.Lock()
    start = time.perf_counter()
    deadline = start + duration

    def user(u: int) -> None:
        k = 0
        while time.perf_counter() < deadline:
            prompt = prompts[(u * 7 + k) % len(prompts)]
            k += 1
            t0 = time.perf_counter()
            try:
                r = requests.post(url + "/generate", timeout=600, json={
                    **body, "messages": [{"role": "user", "content": prompt}], "lookahead": mode})
                out = r.json()
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {out.get('error', {}).get('message', r.text)}")
            except (requests.RequestException, RuntimeError, ValueError) as exc:  # counted and reported, never hidden
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                done.append((time.perf_counter() - t0, out["usage"]["completion_tokens"], out["lookahead"]["compression"]))

    threads = [threading.Thread(target=user, args=(u,), daemon=True) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    lat = sorted(d[0] for d in done)
    comps = [d[2] for d in done if d[2] is not None]
    return {
        "mode": mode, "users": users, "requests": len(done), "errors": len(errors), "error_samples": errors[:3],
        "wall_s": round(wall, 2), "tokens": sum(d[1] for d in done),
        "tokens_per_s": round(sum(d[1] for d in done) / wall, 3),
        "p50_s": round(statistics.median(lat), 3) if lat else None,
        "p95_s": round(lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))], 3) if lat else None,
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
    body = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    levels = []
    print(f"model={health.get('model')} dtype={health.get('dtype')} cpu_capability={health.get('cpu_capability')} "
          f"torch_threads={health.get('torch_threads')} kv_slots={health.get('kv_cache', {}).get('slots')} "
          f"max_new_tokens={args.max_new_tokens} temperature={args.temperature} {args.duration:.0f} s per phase, A B B A")
    print(f"replica RSS before: {health['replica']['rss_mb']} MB")
    print(f"{'users':>5} {'auto tok/s':>11} {'off tok/s':>10} {'ratio':>6} {'auto p50':>9} {'off p50':>8} {'ratio':>6} "
          f"{'auto compr':>10} {'errors':>6}")
    for users in [int(u) for u in args.users.split(",")]:
        phases = [phase(args.url, mode, users, args.duration, prompts, body) for mode in MODES]
        agg = {}
        for mode in ("auto", "off"):
            mine = [p for p in phases if p["mode"] == mode]
            wall, tokens = sum(p["wall_s"] for p in mine), sum(p["tokens"] for p in mine)
            agg[mode] = {"tokens_per_s": tokens / wall if wall else 0.0,
                         "p50_s": statistics.mean(p["p50_s"] for p in mine if p["p50_s"] is not None),
                         "compression": statistics.mean(p["compression"] or 1.0 for p in mine)}
        level = {"users": users, "phases": phases,
                 "throughput_ratio": round(agg["auto"]["tokens_per_s"] / agg["off"]["tokens_per_s"], 3),
                 "p50_ratio": round(agg["auto"]["p50_s"] / agg["off"]["p50_s"], 3),
                 "auto": agg["auto"], "off": agg["off"], "errors": sum(p["errors"] for p in phases)}
        levels.append(level)
        a, o = agg["auto"], agg["off"]
        print(f"{users:>5} {a['tokens_per_s']:>11.2f} {o['tokens_per_s']:>10.2f} {level['throughput_ratio']:>5.2f}x "
              f"{a['p50_s']:>8.2f}s {o['p50_s']:>7.2f}s {level['p50_ratio']:>5.2f}x {a['compression']:>10.2f} {level['errors']:>6}",
              flush=True)
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

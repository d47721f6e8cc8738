"""Bursts beyond what the server queues: each request is served or refused at once with 503, and the
replica's memory does not grow from burst to burst.

    python -m loadtests.overload --bursts 3 --concurrency 200 --max-new-tokens 64

Against a running server (`serve run serve_config.yaml`); prints one JSON summary and exits 1 when a
request got anything but 200 or 503, a refusal took 2 s or more, or RSS grew 10% from the first burst.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import requests

from loadtests.client import generate, generate_body, read_prompts


def health(url: str) -> dict:
    return requests.get(url + "/health", timeout=30).json()


def one_burst(url: str, concurrency: int, max_new_tokens: int, prompts: list[str]) -> dict:
    """`concurrency` streamed chat requests at once; waits for all, then for the replica to drain."""
    bodies = [generate_body(prompts[i % len(prompts)], chat=True, max_new_tokens=max_new_tokens) for i in range(concurrency)]
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda b: generate(url, b, timeout_s=600), bodies))
    deadline = time.time() + 120
    while time.time() < deadline and health(url)["running"]:
        time.sleep(0.5)
    refused = [o.latency for o in outs if o.status == 503]
    return {"statuses": dict(Counter(o.status for o in outs)), "served": sum(o.ok for o in outs),
            "slowest_refusal_ms": round(1000 * max(refused)) if refused else None,
            "other_errors": sorted({o.error for o in outs if not o.ok and o.status != 503 and o.error})[:3],
            "rss_mb_after": health(url)["replica"]["rss_mb"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.overload", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    before = health(args.url)
    prompts = read_prompts("chat")
    bursts = [one_burst(args.url, args.concurrency, args.max_new_tokens, prompts) for _ in range(args.bursts)]
    after = health(args.url)
    rss = [b["rss_mb_after"] for b in bursts]
    problems = []
    if any(set(b["statuses"]) - {200, 503} or b["other_errors"] for b in bursts):
        problems.append("a request got neither a completion nor a 503")
    if any((b["slowest_refusal_ms"] or 0) >= 2000 for b in bursts):
        problems.append("a refusal took 2 s or more")
    if rss[-1] >= 1.1 * rss[0]:
        problems.append(f"RSS grew from {rss[0]} to {rss[-1]} MB")
    if after["replica"]["pid"] != before["replica"]["pid"]:
        problems.append("the replica restarted")
    print(json.dumps({"args": vars(args), "cpu_capability": before.get("cpu_capability"), "rss_mb_before": before["replica"]["rss_mb"],
                      "bursts": bursts, "status_after": after.get("status"), "problems": problems}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

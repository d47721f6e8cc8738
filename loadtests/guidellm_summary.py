"""The figures of a GuideLLM JSON report that docs/BENCHMARKS.md quotes: requests, errors, TTFT, ITL.

    python -m loadtests.guidellm_summary /tmp/guidellm-vs-locust/guidellm.json
"""
from __future__ import annotations

import json
import sys

METRICS = (("time_to_first_token_ms", "TTFT ms"), ("inter_token_latency_ms", "ITL ms"),
           ("time_per_output_token_ms", "TPOT ms"), ("request_latency", "latency s"))


def summary(report: dict) -> list[dict]:
    rows = []
    for bench in report["benchmarks"]:
        m = bench["metrics"]
        row = {"strategy": bench["config"]["strategy"].get("type_", "?"),
               "streams": bench["config"]["strategy"].get("streams"), **m["request_totals"],
               "output_tok_s": round(m["output_tokens_per_second"]["successful"]["mean"], 2)}
        for key, label in METRICS:
            s = m[key]["successful"]
            row[label] = {"p50": round(s["median"], 2), "p95": round(s["percentiles"]["p95"], 2)}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    path = (argv if argv is not None else sys.argv[1:])[0]
    with open(path) as f:
        rows = summary(json.load(f))
    for row in rows:
        print(json.dumps(row))
    return 1 if any(r["errored"] or r["incomplete"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

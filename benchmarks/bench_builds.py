"""Two builds of this package, interleaved on one machine: `bench_decode` run from each checkout in
turn, so both meet the same host load, and the after/before ratios of every configuration.

    python -m benchmarks.bench_builds --before ../base --after . --rounds 2 -- \\
        --prompts benchmarks/prompts/chat.jsonl --chat --num-prompts 4 --dtype float32 \\
        --configs 3,2,2 --pld "" --engine-compile off

Each checkout runs its own `benchmarks/bench_decode.py` with itself first on PYTHONPATH. Host ms
per step is the share of decode time outside the forward over decode steps (the same formula for
both builds, from fields every version reports).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def run(checkout: Path, args: list[str]) -> dict[str, dict]:
    """One bench_decode run from `checkout`; its rows by configuration."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        subprocess.run([sys.executable, "-m", "benchmarks.bench_decode", *args, "--json", str(out)], cwd=checkout,
                       env=env, check=True, stdout=subprocess.DEVNULL)
        return {row["config"]: row for row in json.loads(out.read_text())["rows"]}


def host_ms(row: dict) -> float | None:
    """Host ms per decode step: the host share of decode time, over steps per second."""
    if row.get("host_overhead") is None or not row.get("compression"):
        return None
    return 1000 * row["host_overhead"] * row["compression"] / row["tokens_per_s"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="checkout of the build before")
    ap.add_argument("--after", type=Path, required=True, help="checkout of the build after")
    ap.add_argument("--rounds", type=int, default=2, help="before/after pairs, interleaved")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: bench_decode's arguments")
    args = ap.parse_args(argv)
    bench_args = [a for a in args.bench_args if a != "--"]
    runs: dict[str, list[dict[str, dict]]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for name in ("before", "after"):
            runs[name].append(run(getattr(args, name).resolve(), bench_args))
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, torch threads {torch.get_num_threads()}, "
          f"{args.rounds} interleaved rounds; bench_decode {' '.join(bench_args)}")
    print(f"{'config':<18}{'build':>7}{'tok/s':>8}{'host ms':>9}{'compr.':>8}{'same':>7}")
    figures = {}
    for config in runs["before"][0]:
        for name in ("before", "after"):
            rows = [r[config] for r in runs[name]]
            hosts = [h for h in map(host_ms, rows) if h is not None]
            figures[(config, name)] = fig = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
                "host_ms_per_step": statistics.median(hosts) if hosts else None,
                "compression": rows[0]["compression"], "identical": [r["identical"] for r in rows]}
            hm = "-" if fig["host_ms_per_step"] is None else f"{fig['host_ms_per_step']:.2f}"
            comp = "-" if fig["compression"] is None else f"{fig['compression']:.2f}"
            print(f"{config:<18}{name:>7}{fig['tokens_per_s']:>8.1f}{hm:>9}{comp:>8}{','.join(fig['identical']):>7}")
        b, a = figures[(config, "before")], figures[(config, "after")]
        print(f"{config:<18}{'after/before':>15} tok/s {a['tokens_per_s'] / b['tokens_per_s']:.3f}x")
    report = {f"{c}/{n}": f for (c, n), f in figures.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

"""Soak (and optional replica kill) under locust load, sampling the model replica's memory.

    python -m loadtests.soak --minutes 20 --users 4 --out results/loadtests/soak
    python -m loadtests.soak --minutes 3 --users 4 --kill-at 60 --out results/loadtests/kill
    python -m loadtests.soak --minutes 10 --users 16 --mix off=4,fixed=1,hot=1,stop=1,choices=1 \
        --probe-s 0.1 --baseline-minutes 3 --out results/loadtests/mix

Without --host it starts `serve run serve_config.yaml` and stops it at the end. Every
--sample-s seconds it reads /health (replica pid, RSS, queue depth). With --kill-at it kills the
model replica at that second through Ray and measures the time until a request succeeds again.
Exit status 1 when: any request failed (soak), RSS grew by 10% or more after the warm-up, or a
replica restarted that nobody killed. With --probe-s a thread GETs /health that often (a load
balancer's probe) and any answer but 200 fails the soak; with --baseline-minutes the same users
first send "off" requests alone, and the mix's "off" TPOT p95 must stay within 1.2x of theirs.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from .campaign import ROOT, start_server, stop_server

RSS_GROWTH_LIMIT = 0.10
OFF_TPOT_LIMIT = 1.2  # the mix's "off" TPOT p95 over the baseline's


class Prober(threading.Thread):
    """GET /health every `every_s` seconds until stopped: answers by status, slowest answer."""

    def __init__(self, host: str, every_s: float) -> None:
        super().__init__(daemon=True)
        self.host, self.every_s = host, every_s
        self.statuses: dict[str, int] = {}
        self.slowest_ms = 0.0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.every_s):
            t0 = time.perf_counter()
            try:
                status = str(requests.get(self.host + "/health", timeout=10).status_code)
            except requests.RequestException as exc:
                status = type(exc).__name__
            self.slowest_ms = max(self.slowest_ms, 1000 * (time.perf_counter() - t0))
            self.statuses[status] = self.statuses.get(status, 0) + 1


def run_locust(host: str, args, minutes: float, mix: str) -> subprocess.Popen:
    """Locust's headless run against `host`, its summary written to `args.summary`."""
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless",
           "-u", str(args.users), "-r", str(args.users), "-t", f"{int(minutes * 60)}s", "--host", host,
           "--slo-file", str(ROOT / args.slo), "--lookahead", args.lookahead, "--max-new-tokens", str(args.max_new_tokens),
           "--summary-json", str(args.summary), "--only-summary", "--stop-timeout", "30", "--loglevel", "WARNING",
           *(["--mix", mix] if mix else [])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOKAHEAD_SHAPE")}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def off_tpot_p95(summary: dict) -> float | None:
    return ((summary.get("by_kind") or {}).get("off", {}).get("tpot") or {}).get("p95")


def sample(host: str) -> dict | None:
    try:
        h = requests.get(host + "/health", timeout=10).json()
    except (requests.RequestException, ValueError):
        return None
    r = h.get("replica", {})
    return {"pid": r.get("pid"), "rss_mb": r.get("rss_mb"), "running": h.get("running"), "waiting": h.get("waiting"),
            "engine_steps": r.get("engine_steps"), "aborted": r.get("aborted_requests")}


def kill_model_replica(address: str) -> str:
    """Kill one LookaheadModel replica actor; returns its name."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # as `make serve` starts the cluster
    ray.init(address=address, namespace="serve", log_to_driver=False, configure_logging=False)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#LookaheadModel#" in a["name"]]
    if not names:
        raise RuntimeError("no LookaheadModel replica found in the Ray cluster")
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


def time_to_recover(host: str, t_kill: float, limit_s: float = 300) -> float | None:
    while time.time() - t_kill < limit_s:
        try:
            r = requests.post(host + "/generate", json={"prompt": "def f():", "max_new_tokens": 4}, timeout=30)
            if r.status_code == 200:
                return time.time() - t_kill
        except requests.RequestException:
            pass
        time.sleep(0.2)
    return None


def rss_growth(samples: list[dict], warmup_s: float) -> dict[int, dict]:
    """Per replica pid: RSS after the warm-up, at the end, peak, and relative growth."""
    out: dict[int, dict] = {}
    for s in samples:
        if s["pid"] is None or s["rss_mb"] is None:
            continue
        d = out.setdefault(s["pid"], {"first": s["rss_mb"], "first_t": s["t"], "warm": None, "last": s["rss_mb"], "peak": 0.0})
        if d["warm"] is None and s["t"] - d["first_t"] >= warmup_s:
            d["warm"] = s["rss_mb"]
        d["last"], d["peak"] = s["rss_mb"], max(d["peak"], s["rss_mb"])
    for d in out.values():
        base = d["warm"] if d["warm"] is not None else d["first"]
        d["growth"] = (d["last"] - base) / base
    return out


def write_report(out: Path, args, samples: list[dict], summary: dict, growth: dict, kill: dict | None,
                 extra: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "samples.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(samples[0]))
        w.writeheader()
        w.writerows(samples)
    lines = [f"# Soak: {args.users} users for {args.minutes:g} min" + (f", replica killed at {args.kill_at:g} s" if kill else ""), "",
             f"Command: `python -m loadtests.soak {' '.join(sys.argv[1:])}`", "",
             f"- requests: {summary.get('requests', 0)}, failures: {summary.get('failures', 0)}",
             f"- locust SLO verdict: {'met' if not summary.get('breaches') else '; '.join(summary['breaches'])}",
             *extra]
    figs = summary.get("figures", {})
    for entry in ("ttft", "tpot", "e2e"):
        if entry in figs:
            lines.append(f"- {entry} p50 / p95 / p99: {figs[entry]['p50']:.0f} / {figs[entry]['p95']:.0f} / {figs[entry]['p99']:.0f} ms")
    by_kind = summary.get("by_kind") or {}
    if by_kind:
        lines += ["", "| request kind | requests | TTFT p50 / p95 ms | TPOT p50 / p95 ms |", "| --- | ---: | ---: | ---: |"]
        for kind, f in sorted(by_kind.items()):
            tpot = f.get("tpot", {})
            tp = f"{tpot['p50']:.1f} / {tpot['p95']:.1f}" if tpot.get("p50") is not None else "-"
            lines.append(f"| {kind} | {f['ttft']['count']} | {f['ttft']['p50']:.0f} / {f['ttft']['p95']:.0f} | {tp} |")
    lines += ["", f"| replica pid | RSS first MB | RSS after {args.warmup_s:g} s warm-up | RSS last | peak | growth since warm-up |",
              "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for pid, d in growth.items():
        warm = "-" if d["warm"] is None else f"{d['warm']:.1f}"
        lines.append(f"| {pid} | {d['first']:.1f} | {warm} | {d['last']:.1f} | {d['peak']:.1f} | {100 * d['growth']:+.1f}% |")
    if kill:
        lines += ["", f"- killed `{kill['replica']}` at {kill['at_s']:.0f} s; a request succeeded again after "
                      f"**{kill['recovery_s']:.1f} s**" if kill["recovery_s"] is not None else "- no recovery within the limit"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for pid in growth:
        pts = [(s["t"], s["rss_mb"]) for s in samples if s["pid"] == pid and s["rss_mb"] is not None]
        ax.plot([p[0] / 60 for p in pts], [p[1] for p in pts], marker=".", label=f"replica {pid}")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS MB")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "rss.png", dpi=100)
    plt.close(fig)
    lines += ["", "![replica RSS](rss.png)", ""]
    (out / "README.md").write_text("\n".join(lines))
    (out / "summary.json").write_text(json.dumps({"locust": summary, "rss": growth, "kill": kill, "notes": extra},
                                                 indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default=None)
    ap.add_argument("--serve-config", default="serve_config.yaml")
    ap.add_argument("--ray-address", default="auto", help="for --kill-at: the cluster `serve run` started")
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lookahead", default="auto")
    ap.add_argument("--mix", default="", help='kinds of request by weight, e.g. "off=4,fixed=1,top_p=1,stop=1" (loadtests/client.py)')
    ap.add_argument("--slo", default="loadtests/slo.yaml")
    ap.add_argument("--sample-s", type=float, default=10)
    ap.add_argument("--warmup-s", type=float, default=60)
    ap.add_argument("--kill-at", type=float, default=None, help="kill the model replica this many seconds in")
    ap.add_argument("--probe-s", type=float, default=None, help="GET /health this often, as a load balancer probes")
    ap.add_argument("--baseline-minutes", type=float, default=0,
                    help='first the same users with "off" requests alone: the TPOT the mix\'s "off" requests are held to')
    ap.add_argument("--out", default="results/loadtests/soak")
    args = ap.parse_args(argv)

    host, proc = args.host, None
    if host is None:
        print(f"starting serve run {args.serve_config} ...", file=sys.stderr)
        proc, host = start_server(args.serve_config, 180)
    samples: list[dict] = []
    kill: dict | None = None
    baseline: dict | None = None
    prober = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args.summary = summary_path = Path(tmp) / "summary.json"
            if args.baseline_minutes:
                print(f'baseline: {args.users} users, "off" alone, {args.baseline_minutes:g} min', file=sys.stderr)
                base = run_locust(host, args, args.baseline_minutes, "off=1")
                base.communicate()
                baseline = json.loads(summary_path.read_text()) if summary_path.exists() else {}
                summary_path.unlink(missing_ok=True)
            if args.probe_s:
                prober = Prober(host, args.probe_s)
                prober.start()
            locust = run_locust(host, args, args.minutes, args.mix)
            t0 = time.time()
            killer = None
            while locust.poll() is None:
                s = sample(host)
                if s is not None:
                    samples.append({"t": round(time.time() - t0, 1), **s})
                    print(f"[{samples[-1]['t']:6.0f}s] pid {s['pid']} rss {s['rss_mb']} MB running {s['running']} waiting {s['waiting']}",
                          file=sys.stderr)
                if args.kill_at is not None and kill is None and time.time() - t0 >= args.kill_at:
                    t_kill = time.time()
                    kill = {"at_s": t_kill - t0, "replica": kill_model_replica(args.ray_address), "recovery_s": None}

                    def recover(k=kill, t=t_kill):
                        k["recovery_s"] = time_to_recover(host, t)

                    killer = threading.Thread(target=recover, daemon=True)
                    killer.start()
                time.sleep(args.sample_s if kill is None or killer is None or not killer.is_alive() else 0.5)
            output = locust.stdout.read()
            print(output[-3000:], file=sys.stderr)
            if killer is not None:
                killer.join(timeout=300)
            summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"breaches": ["locust wrote no summary"]}
    finally:
        if prober is not None:
            prober.halt.set()
        if proc is not None:
            stop_server(proc)
    growth = rss_growth(samples, args.warmup_s)
    problems, extra = [], []
    if prober is not None:
        extra.append(f"- /health every {args.probe_s:g} s: answers by status {prober.statuses}, slowest "
                     f"{prober.slowest_ms:.0f} ms")
        if set(prober.statuses) != {"200"}:
            problems.append(f"/health answered {prober.statuses}")
    if baseline is not None:
        base_p95, mix_p95 = off_tpot_p95(baseline), off_tpot_p95(summary)
        if base_p95 and mix_p95:
            ratio = mix_p95 / base_p95
            extra.append(f'- "off" TPOT p95: {mix_p95:.1f} ms in the mix, {base_p95:.1f} ms alone '
                         f"({args.baseline_minutes:g} min, {baseline.get('requests', 0)} requests): **{ratio:.2f}x** "
                         f"(limit {OFF_TPOT_LIMIT}x)")
            if ratio > OFF_TPOT_LIMIT:
                problems.append(f'"off" TPOT p95 {ratio:.2f}x the baseline\'s')
        else:
            problems.append('no "off" TPOT in the baseline or the mix')
    out = Path(args.out)
    write_report(out, args, samples, summary, growth, kill, extra)
    if kill is None and summary.get("failures", 1):
        problems.append(f"{summary.get('failures')} failed requests")
    grown = {pid: d["growth"] for pid, d in growth.items() if d["warm"] is not None and d["growth"] >= RSS_GROWTH_LIMIT}
    if grown:
        problems.append(f"RSS grew >= {RSS_GROWTH_LIMIT:.0%} after the warm-up: {grown}")
    if kill is None and len(growth) > 1:
        problems.append(f"replica restarted: pids {list(growth)}")
    if kill is not None and kill["recovery_s"] is None:
        problems.append("no request succeeded after the kill")
    print(f"report: {out / 'README.md'}; " + ("OK" if not problems else "FAILED: " + "; ".join(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""Run a load-test campaign: every stage under every policy, then a markdown + PNG report.

    python -m loadtests.campaign --config loadtests/campaigns/full.yaml
    python -m loadtests.campaign --config loadtests/campaigns/smoke.yaml --host http://127.0.0.1:8000

Policies are the requests' `lookahead` field: "off" (plain), "n,w,g" (fixed) or "auto" (the
engine's own setting, each step as wide as pays). Without --host (or `host:` in the file) the campaign starts
`serve run <serve_config>` and stops it at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml
from pydantic import BaseModel, ConfigDict, Field

from deployments.ray_env import held_ports, prepare, serve_ports

ROOT = Path(__file__).resolve().parent.parent


class Stage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    users: int = Field(ge=1)
    duration_s: float = Field(gt=0)


class Campaign(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    host: str | None = None
    serve_config: str = "serve_config.yaml"
    slo: str = "loadtests/slo.yaml"
    prompt_set: str = "code"
    max_new_tokens: int = Field(64, ge=1)
    policies: list[str] = ["off", "auto"]
    stages: list[Stage]
    out: str = "results/loadtests/{name}"
    gate: bool = Field(True, description="exit non-zero when any run breaches its SLO")
    startup_timeout_s: float = 180


def start_server(serve_config: str, timeout: float) -> tuple[subprocess.Popen, str]:
    """`serve run serve_config` in a session of its own, with configs/ray.env and this user's
    private folder (deployments/ray_env.py), once /health answers; refused, naming what holds them,
    where its ports are taken (a HAProxy left by an earlier run answered /health with 500s)."""
    env = {**os.environ, **prepare()}
    os.environ.setdefault("RAY_TMPDIR", env["RAY_TMPDIR"])  # where ray.init(address="auto") here finds it
    bind, ports = serve_ports(ROOT / serve_config, env)
    if held := held_ports(ports, bind):
        raise RuntimeError(f"cannot start serve run {serve_config}: " + "; ".join(held))
    serve = Path(sys.executable).with_name("serve")
    log = open(Path(tempfile.gettempdir()) / "lookahead-campaign-serve.log", "w")
    proc = subprocess.Popen([str(serve), "run", serve_config], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, umask=0o077)
    host = f"http://127.0.0.1:{ports['HTTP']}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited with {proc.returncode}; see {log.name}")
        try:
            if requests.get(host + "/health", timeout=5).status_code == 200:
                return proc, host
        except requests.RequestException:
            pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"the server did not answer /health within {timeout:.0f}s; see {log.name}")


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a server started in a session of its own: SIGTERM to the server itself (`serve run` then
    shuts Serve down in order, HAProxy with it; SIGTERM or Ctrl-C to its whole group at once took
    30 s, and left HAProxy holding the ports until HAProxy was made to end with its manager,
    deployments/ray_env.py), then its group, harder; then whatever of its group outlived it (vLLM's
    engine core)."""
    for kill, sig, wait in ((os.kill, signal.SIGTERM, 60), (os.killpg, signal.SIGTERM, 15), (os.killpg, signal.SIGKILL, 5)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            kill(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)


def run_locust(host: str, c: Campaign, policy: str, stage: Stage, workdir: Path) -> dict:
    summary = workdir / f"{policy.replace(',', '-')}-{stage.users}.json"
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless",
           "-u", str(stage.users), "-r", str(stage.users), "-t", f"{int(stage.duration_s)}s", "--host", host,
           "--slo-file", str(ROOT / c.slo), "--prompt-set", c.prompt_set, "--lookahead", policy,
           "--max-new-tokens", str(c.max_new_tokens), "--summary-json", str(summary), "--only-summary",
           "--stop-timeout", "30", "--loglevel", "WARNING"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOKAHEAD_SHAPE")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    result = json.loads(summary.read_text()) if summary.exists() else {"breaches": [f"locust failed: {proc.stderr[-500:]}"], "figures": {}}
    result.update({"policy": policy, "users": stage.users, "exit_code": proc.returncode})
    return result


def _fig(r: dict, entry: str, p: str) -> float:
    return r["figures"].get(entry, {}).get(p, float("nan"))


def write_report(c: Campaign, results: list[dict], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for r in results:
        dur = r.get("duration_s") or 1
        r["throughput_tok_s"] = r.get("tokens", 0) / dur
        r["goodput_rps"] = r.get("met_slo", 0) / dur
    lines = [f"# Load-test campaign `{c.name}`", "",
             f"{len(c.stages)} stages x {len(c.policies)} policies; prompts `{c.prompt_set}`, max_new_tokens {c.max_new_tokens}, "
             f"SLO file `{c.slo}`. Latencies in ms. Goodput = requests per second that met every SLO bound.", "",
             "| policy | users | requests | fail | TTFT p50 / p95 | TPOT p50 / p95 | e2e p50 / p95 | tokens/s | goodput req/s "
             "| compression p50 | steps by kind | SLO |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in results:
        mix = ", ".join(f"{k}: {v}" for k, v in sorted(r.get("mix", {}).items()))
        verdict = "met" if not r["breaches"] else "breach: " + "; ".join(r["breaches"])
        lines.append(f"| {r['policy']} | {r['users']} | {r.get('requests', 0)} | {r.get('failures', 0)} | "
                     f"{_fig(r, 'ttft', 'p50'):.0f} / {_fig(r, 'ttft', 'p95'):.0f} | "
                     f"{_fig(r, 'tpot', 'p50'):.1f} / {_fig(r, 'tpot', 'p95'):.1f} | "
                     f"{_fig(r, 'e2e', 'p50'):.0f} / {_fig(r, 'e2e', 'p95'):.0f} | {r['throughput_tok_s']:.0f} | {r['goodput_rps']:.2f} | "
                     f"{r.get('compression_p50') or 1.0:.2f} | {mix} | {verdict} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 3, figsize=(16, 8.5))
    for i, policy in enumerate(c.policies):
        rs = sorted((r for r in results if r["policy"] == policy), key=lambda r: r["users"])
        xs = [r["users"] for r in rs]
        color = plt.cm.tab10(i)
        kw = dict(marker="o", lw=2.5 if policy == "auto" else 1.2, label=policy, color=color)
        for col, entry in enumerate(("ttft", "tpot", "e2e")):
            ax[0][col].plot(xs, [_fig(r, entry, "p50") for r in rs], **kw)
            ax[0][col].plot(xs, [_fig(r, entry, "p95") for r in rs], ls="--", alpha=0.5, color=color)
        ax[1][0].plot(xs, [r["throughput_tok_s"] for r in rs], **kw)
        ax[1][1].plot(xs, [r["goodput_rps"] for r in rs], **kw)
        ax[1][2].plot(xs, [r.get("compression_p50") or 1.0 for r in rs], **kw)
    titles = ["TTFT ms (dashed p95)", "TPOT ms (dashed p95)", "end-to-end ms (dashed p95)", "throughput, output tokens/s",
              "goodput, requests/s meeting every SLO", "compression (tokens/step), p50"]
    for a, t in zip(ax.flat, titles):
        a.set_title(t, fontsize=10)
        a.set_xlabel("concurrent users")
        a.grid(alpha=0.3)
    ax[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "latency_throughput.png", dpi=100)
    plt.close(fig)
    auto = sorted((r for r in results if r["policy"] == "auto"), key=lambda r: r["users"])
    if auto:
        keys = sorted({k for r in auto for k in r.get("mix", {})})
        fig, a = plt.subplots(figsize=(7, 4))
        bottom = [0.0] * len(auto)
        for k in keys:
            share = [r.get("mix", {}).get(k, 0) / max(1, sum(r.get("mix", {}).values())) for r in auto]
            a.bar([str(r["users"]) for r in auto], share, bottom=bottom, label=k)
            bottom = [b + s for b, s in zip(bottom, share)]
        a.set_xlabel("concurrent users")
        a.set_ylabel("share of decode steps")
        a.set_title("what the planner ran for \"auto\" requests: plain, verify or full steps")
        a.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "step_kinds.png", dpi=100)
        plt.close(fig)
        lines += ["", "![step kinds](step_kinds.png)"]
    lines += ["", "![latency and throughput](latency_throughput.png)", ""]
    (out / "README.md").write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return out / "README.md"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loadtests.campaign", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", required=True)
    ap.add_argument("--host", default=None, help="target a running server instead of starting one")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    c = Campaign.model_validate(yaml.safe_load(Path(args.config).read_text()))
    out = Path(args.out or c.out.format(name=c.name))
    host, proc = args.host or c.host, None
    if host is None:
        print(f"starting serve run {c.serve_config} ...", file=sys.stderr)
        proc, host = start_server(c.serve_config, c.startup_timeout_s)
    results = []
    try:
        runs = [(p, s) for s in c.stages for p in c.policies]
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            for i, (policy, stage) in enumerate(runs):
                left = sum(s.duration_s for _, s in runs[i:])
                print(f"[{i + 1}/{len(runs)}] policy {policy}, {stage.users} users, {stage.duration_s:.0f}s "
                      f"({time.perf_counter() - start:.0f}s elapsed, ~{left:.0f}s left)", file=sys.stderr)
                results.append(run_locust(host, c, policy, stage, Path(tmp)))
    finally:
        if proc is not None:
            stop_server(proc)
    report = write_report(c, results, out)
    breached = [r for r in results if r["breaches"]]
    print(f"report: {report}; {len(results) - len(breached)}/{len(results)} runs met their SLOs")
    return 1 if (c.gate and breached) else 0


if __name__ == "__main__":
    sys.exit(main())

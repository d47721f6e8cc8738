"""A black-box check of the shipped server on a shared host, with API keys on.

    python -m loadtests.blackbox --out results/loadtests/blackbox

Starts `serve run` on serve_config.yaml with `auth: {api_keys_env: LOOKAHEAD_API_KEYS}` (a key
made for the run), then checks from outside what another user of the host or the network, or
another client, could reach: /health without a key shows no traffic figures; nothing under
HAProxy's and Ray's runtime folders is writable or reachable by other users, and no stats or
metrics port listens on every interface (loadtests/host_audit.py); the compiled-package root is
0700; with one client holding an `n: 16`, 256-token request on a ~600-token prompt, a second
client's first token arrives within 3 s. Exit status 1 when any check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import yaml

from . import host_audit
from .campaign import ROOT, start_server, stop_server

SECOND_CLIENT_TTFT_S = 3.0
FIGURES = ("prefix_cache", "history", "step_costs_ms", "step_totals_ms", "running", "waiting", "replica")
LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the quiet river bank. " * 40  # ~600 tokens


def keyed_config(path: Path, env_var: str) -> Path:
    """`path` with API keys read from `env_var`, written beside the temporary files."""
    config = yaml.safe_load(path.read_text())
    for app in config["applications"]:
        app["args"]["auth"] = {"api_keys_env": env_var}
    out = Path(tempfile.mkdtemp(prefix="lookahead-blackbox-")) / "serve_config.yaml"
    out.write_text(yaml.safe_dump(config))
    return out


def first_token_s(host: str, key: str, path: str, body: dict, started: threading.Event | None = None) -> dict:
    """Stream `body` to `path`: seconds to the first chunk with text, to the end, and the usage."""
    t0 = time.perf_counter()
    first, usage, status = None, None, None
    with requests.post(host + path, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                       headers={"Authorization": f"Bearer {key}"}, stream=True, timeout=600) as r:
        status = r.status_code
        if started is not None:
            started.set()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text and first is None:
                    first = time.perf_counter() - t0
            usage = event.get("usage") or usage
    return {"status": status, "first_token_s": first, "total_s": time.perf_counter() - t0, "usage": usage}


def check_fairness(host: str, key: str) -> dict:
    """A short chat request alone, then 1 s after an n=16 request on a long prompt started."""
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
            "temperature": 0}
    alone = first_token_s(host, key, "/v1/chat/completions", chat)
    big: dict = {}
    started = threading.Event()
    body = {"prompt": LONG_PROMPT, "n": 16, "max_tokens": 256, "ignore_eos": True, "temperature": 0.8}
    holder = threading.Thread(target=lambda: big.update(first_token_s(host, key, "/v1/completions", body, started)))
    holder.start()
    started.wait(60)
    time.sleep(1.0)
    second = first_token_s(host, key, "/v1/chat/completions", chat)
    holder.join()
    return {"alone": alone, "n16": big, "second": second,
            "ok": big.get("status") == 200 and second["first_token_s"] is not None
            and second["first_token_s"] <= SECOND_CLIENT_TTFT_S}


def wait_for_graphs(host: str, key: str, timeout_s: float) -> float:
    """Seconds until /health shows every compiled graph ready (a first start compiles them while serving)."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        h = requests.get(host + "/health", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
        if h.get("compiled_decode", {}).get("ready"):
            break
        time.sleep(2)
    return time.time() - t0


def check_health(host: str, key: str) -> dict:
    open_health = requests.get(host + "/health", timeout=30)
    keyed = requests.get(host + "/health", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    shown = sorted(set(open_health.json()) & set(FIGURES))
    return {"open": open_health.json(), "open_status": open_health.status_code, "figures_without_key": shown,
            "figures_with_key": sorted(set(keyed) & set(FIGURES)), "ok": open_health.status_code == 200 and not shown}


def check_host() -> dict:
    """The private runtime folder (Ray's sessions, HAProxy's files) as another user sees it, and
    HAProxy's stats and metrics ports and Ray's metrics ports on every interface."""
    from deployments.ray_env import prepare, runtime_dir

    env = prepare()
    folders = [runtime_dir()]
    session = folders[0] / "ray" / "session_latest"
    ports = {int(env.get(v, d)) for v, d in (("RAY_SERVE_HAPROXY_STATS_PORT", "8404"),
                                               ("RAY_SERVE_HAPROXY_METRICS_PORT", "9101"))} | {44217, 44227}
    findings = host_audit.audit([*folders, session.resolve()], ports)
    return {"folders": [str(f) for f in folders], "session": str(session.resolve()),
            "mode": oct(folders[0].stat().st_mode & 0o777), "stats_and_metrics_ports": sorted(ports),
            "findings": findings, "every_interface": host_audit.open_listeners(), "ok": not findings}


def check_package_root() -> dict:
    from lookahead_core.engine.graphs.package_store import default_root

    root = default_root()
    mode = root.stat().st_mode & 0o777 if root.exists() else None
    return {"root": str(root), "mode": None if mode is None else oct(mode), "ok": mode == 0o700}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.blackbox", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve-config", default="serve_config.yaml")
    ap.add_argument("--out", default="results/loadtests/blackbox")
    args = ap.parse_args(argv)
    key = secrets.token_urlsafe(24)
    os.environ["LOOKAHEAD_API_KEYS"] = key
    config = keyed_config(ROOT / args.serve_config, "LOOKAHEAD_API_KEYS")
    proc, host = start_server(str(config), 1800)
    try:
        report = {"health": check_health(host, key), "host": check_host(), "package_root": check_package_root()}
        report["graphs_ready_after_s"] = {"s": round(wait_for_graphs(host, key, 1200), 1), "ok": True}
        report["fairness"] = check_fairness(host, key)
    finally:
        stop_server(proc)
    failed = [name for name, part in report.items() if not part["ok"]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))
    print(f"report: {out / 'report.json'}; " + ("OK" if not failed else "FAILED: " + ", ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

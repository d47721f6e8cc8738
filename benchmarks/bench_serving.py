"""This server against vLLM's CPU server, served the same weights on the same cores, one script run.

First our engine in-process (the served config's engine and core plan, compiled), driven at the same
levels as the server, with no HTTP: the bar the served steps are held to. Then each server is
started in turn on this machine (never both at once: they would share the cores), then driven by the
same client (`loadtests/client.py`): closed-loop users streaming `/v1/chat/completions` (chat
prompts through the model's chat template, temperature 0, streamed with the usage chunk). At each
user count every prompt of the set is sent once, so no answer is copied from an earlier request; our
replica's cross-request history is reported on or off beside each figure (`--history off` turns it
off in the served config). Ours runs `"auto"` and `"off"` (the request's `lookahead` field) on the
same server, side by side at each user count; vLLM runs plain decoding. Our server is driven once
every compiled graph is ready and timed alone (the planner prices widths from those timings).

    make bench-serving                                  # sets vLLM up in .venv-vllm, then runs this
    python -m benchmarks.bench_serving --users 1,4,16 --json results/serving.json
    python -m benchmarks.bench_serving --servers ours --ours-url http://127.0.0.1:8000   # a running server

Throughput is completion tokens over the time from a level's first request to its last answer;
TTFT is the first text chunk, TPOT the time per token after it, e2e the whole request. Around each
of our levels the server's forward totals are read: the level's mean one-token step served, against
the same cell's mean at the same level in-process and the same graph timed alone on the engine's
thread, is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import requests
import yaml

from deployments.ray_env import prepare
from loadtests.campaign import stop_server
from loadtests.client import ClosedLoop, Outcome, chat_body, each_once, generate, percentiles, read_prompts
from lookahead_core.engine.host.async_engine import STATUS_MAX_AGE_S

ROOT = Path(__file__).resolve().parent.parent


def health_now(url: str) -> dict:
    """/health with figures newer than any read before it (the engine's status is read at most every
    STATUS_MAX_AGE_S, whoever asks)."""
    time.sleep(STATUS_MAX_AGE_S + 0.1)
    return requests.get(url + "/health", timeout=30).json()


def level(url: str, bodies: list[dict], users: int) -> dict:
    """Every body sent once by `users` closed-loop users; tokens/s, latency percentiles, errors."""
    start = time.time()
    outcomes = ClosedLoop(url, users, each_once(bodies), timeout_s=600, route="/v1/chat/completions").run(1e9)
    return summarize(outcomes, start)


def summarize(outcomes: list[Outcome], start: float) -> dict:
    done = [o for o in outcomes if o.ok]
    wall = max((o.end for o in outcomes), default=start) - start
    tokens = sum(o.tokens for o in done)
    out = {"requests": len(done), "errors": len(outcomes) - len(done),
           "error_samples": [o.error for o in outcomes if not o.ok][:3], "tokens": tokens,
           "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0}
    for name in ("ttft", "tpot", "latency"):
        p = percentiles([getattr(o, name) for o in done], (50, 95))
        out[name] = {k: None if v is None else round(1000 * v, 1) for k, v in p.items()}  # ms
    # our usage chunk's lookahead summary: tokens per decode step over the level's steps (vLLM sends none)
    runs = [(s["compression"], s["steps"]) for o in done
            if (s := (o.summary or {}).get("lookahead")) and s.get("compression") is not None and s.get("steps")]
    steps = sum(n for _, n in runs)
    out["tokens_per_step"] = round(sum(c * n for c, n in runs) / steps, 2) if steps else None
    return out


def wait_for(check: Callable[[], bool], timeout_s: float, what: str, proc: subprocess.Popen | None = None,
             interval_s: float = 2.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the server exited with {proc.returncode}")
        try:
            if check():
                return
        except requests.RequestException:
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"{what}: not ready after {timeout_s:.0f} s")


class Server:
    """A server process in its own session, its output to `log`; stopped as the load-test campaign
    stops its server (SIGTERM: a background `serve run` ignores SIGINT)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True, umask=0o077)

    def stop(self) -> None:
        stop_server(self.proc)
        self.log.close()


def served_config(path: str, history: bool, port: int, out: Path, overrides: list[str] = ()) -> tuple[Path, dict]:
    """The served config with its HTTP port set, `overrides` ("engine.max_batch=8", YAML values) applied
    to the app's args and, with `history` off, nothing copied across requests."""
    config = yaml.safe_load(Path(path).read_text())
    config.setdefault("http_options", {})["port"] = port
    args = config["applications"][0]["args"]
    if not history:
        args.setdefault("engine", {}).update(history_tokens=0, shared_pool_cap=0)
    for item in overrides:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = args
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = yaml.safe_load(value)
    out.write_text(yaml.safe_dump(config))
    return out, args


def served_folder(args: dict) -> str:
    """The save_pretrained folder our replica loads (the GGUF dequantized once), for vLLM to serve."""
    from deployments.config import ModelArgs, resolve_path
    from lookahead_core.models.loading import model_folder

    m = ModelArgs.model_validate(args.get("model", {}))
    return model_folder(resolve_path(m.path), m.gguf_file, m.resolved_cache_dir())


def in_process(app_args: dict, prompts: list[str], users: list[int], modes: list[str], max_tokens: int,
               requests: int | None = None) -> list[dict]:
    """Our engine without the server: the served config's engine and core plan in this process, its
    buckets compiled before timing, driven as the served levels are (`users` requests in flight,
    each level's prompts through the chat template, each mode side by side), each level's forwards
    read from the engine's totals: the same shapes in-process that the served steps are held to."""
    from benchmarks.bench_engine import run_engine
    from deployments.config import AppArgs, resolve_path
    from lookahead_core.engine.engine import Engine
    from lookahead_core.engine.runner.model_runner import ModelRunner
    from lookahead_core.models.loading import load_model

    args = AppArgs.model_validate(app_args)
    core_plan = args.core_plan()
    plan = core_plan.apply()
    m = args.model
    model, tokenizer = load_model(resolve_path(m.path), gguf_file=m.gguf_file, dtype=m.dtype, device=m.device,
                                  cache_dir=m.resolved_cache_dir(), chat_template=m.chat_template)
    cfg = args.engine.model_copy(update={"compile": "on" if args.engine.compile != "off" else "off"})
    engine = Engine(ModelRunner(model, threads=core_plan.step_threads(), weight_layout=cfg.weight_layout), cfg)
    eos = model.generation_config.eos_token_id
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                         return_dict=False) for p in prompts]
    run_engine(engine, ids[:2], 1, 2, max_tokens, "off", eos=eos)  # warm, as the served levels are
    rows = []
    for u in users:
        for mode in modes:
            before = engine.runner.costs.totals()
            r = run_engine(engine, ids, u, max(prompts_per_level(u, len(ids), requests), u), max_tokens, mode, eos=eos)
            costs, forwards = level_costs(before, engine.runner.costs.totals())
            rows.append({"server": f"in-process-{mode}", "users": u, "tokens": r["tokens"],
                         "tokens_per_s": round(r["tokens_per_s"], 2), "torch_threads": plan["torch_threads"],
                         "step_costs_ms": costs, "step_forwards": forwards})
            print(f"{rows[-1]['server']:<12} {u:>5} {rows[-1]['tokens_per_s']:>8.1f}", flush=True)
    return rows


def ours_ready(url: str, timeout_s: float, proc: subprocess.Popen | None, started: float) -> dict:
    """Wait until our server is healthy, and every compiled bucket ready and timed alone (or
    failed): steps run, and are priced, as they will be in service (a request sent while a graph
    is timed skips its timing). Returns when each happened, in seconds: healthy after the start,
    every graph ready (loaded or compiled) and timed after healthy."""
    seen: dict = {}

    def check() -> bool:
        health = requests.get(url + "/health", timeout=10)
        if health.status_code != 200:
            return False
        now = time.time()
        seen.setdefault("healthy", now)
        buckets = health.json().get("compiled_decode", {}).get("buckets") or []
        if all(b["ready"] or "error" in b for b in buckets):
            seen.setdefault("ready", now)
        return all((b["ready"] and b["timed_alone"]) or "error" in b for b in buckets)

    wait_for(check, timeout_s, "our server", proc, interval_s=0.5)
    done = time.time()
    return {"healthy_s": round(seen["healthy"] - started, 1), "ready_after_healthy_s": round(seen["ready"] - seen["healthy"], 1),
            "timed_after_healthy_s": round(done - seen["healthy"], 1)}


def run_levels(url: str, name: str, prompts: list[str], users: list[int], max_tokens: int, model: str,
               extra: dict, requests: int | None = None) -> list[dict]:
    bodies = [chat_body(p, max_tokens=max_tokens, model=model, **extra) for p in prompts]
    for b in bodies[:2]:  # warm: first requests of a fresh process pay one-off costs
        generate(url, b, route="/v1/chat/completions")
    rows = []
    for u in users:
        row = {"server": name, "users": u, **level(url, bodies[: max(prompts_per_level(u, len(bodies), requests), u)], u)}
        rows.append(row)
        print(fmt(row), flush=True)
    return rows


def prompts_per_level(users: int, available: int, requests: int | None = None) -> int:
    """Enough requests that every user runs several after the ramp, and no prompt twice (or
    `requests` of them, for a model too slow for that)."""
    return min(available, requests if requests is not None else max(12, 6 * users))


def fmt(r: dict) -> str:
    return (f"{r['server']:<12} {r['users']:>5} {r['tokens_per_s']:>8.1f} {r['ttft']['p50']:>9} {r['ttft']['p95']:>9} "
            f"{r['tpot']['p50']:>8} {r['tpot']['p95']:>8} {r['latency']['p50']:>9} {r['latency']['p95']:>9} "
            f"{r['requests']:>5} {r['errors']:>4} {r.get('tokens_per_step') or '-':>8}")


HEADER = (f"{'server':<12} {'users':>5} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'TPOT p50':>8} {'TPOT p95':>8} "
          f"{'e2e p50':>9} {'e2e p95':>9} {'reqs':>5} {'errs':>4} {'tok/step':>8}   (ms)")


def ratios(rows: list[dict]) -> list[str]:
    """Ours against vLLM and auto against off, at each user count, from this run's figures."""
    by = {(r["server"], r["users"]): r for r in rows}
    lines = []
    for u in sorted({r["users"] for r in rows}):
        a, o, v = by.get(("ours-auto", u)), by.get(("ours-off", u)), by.get(("vllm", u))
        parts = [f"{u:>3} users:"]
        for mode, served in (("auto", a), ("off", o)):
            if served and (inp := by.get((f"in-process-{mode}", u))):
                parts.append(f"{mode} served/in-process tok/s {served['tokens_per_s'] / inp['tokens_per_s']:.2f}x")
        if a and v:
            parts.append(f"auto/vLLM tok/s {a['tokens_per_s'] / v['tokens_per_s']:.2f}x, "
                         f"TTFT p50 {a['ttft']['p50'] / v['ttft']['p50']:.2f}x, "
                         f"e2e p50 {a['latency']['p50'] / v['latency']['p50']:.2f}x")
        if o and v:
            parts.append(f"off/vLLM tok/s {o['tokens_per_s'] / v['tokens_per_s']:.2f}x")
        if a and o:
            parts.append(f"auto/off tok/s {a['tokens_per_s'] / o['tokens_per_s']:.2f}x")
        lines.append("  ".join(parts))
    return lines


def level_costs(before: dict, after: dict) -> tuple[dict[str, float], dict[str, int]]:
    """The mean ms and the count of the forwards of each cell run between two reads of `/health`
    `step_totals_ms` ({cell: (sum, count)}, over the engine's life)."""
    means, counts = {}, {}
    for cell, (total, n) in after.items():
        was_total, was_n = before.get(cell, (0.0, 0))
        if n > was_n:
            means[cell], counts[cell] = round((total - was_total) / (n - was_n), 3), n - was_n
    return means, counts


def served_steps(rows: list[dict], health: dict) -> list[str]:
    """Each of our levels' one-token step at its users' batch: its mean served cost over the level
    against the same cell's mean in-process at the same level and mode (the in-process rows), and
    against the same graph timed alone on the engine's thread at the start (the fastest of a few calls)."""
    alone = {int(cell[1:].split("t")[0]): ms for b in health.get("compiled_decode", {}).get("buckets") or []
             if not b.get("prefill") for cell, ms in (b.get("alone_ms") or {}).items() if cell.endswith("t1")}
    by = {(r["server"], r["users"]): r for r in rows}
    lines = []
    for r in rows:
        if not r["server"].startswith("ours-"):  # in-process and vLLM rows were not served by ours
            continue
        bucket = 1 << (r["users"] - 1).bit_length()  # the cost table's batch bucket of `users` sequences
        cell = f"b{bucket}t1"
        served = (r.get("step_costs_ms") or {}).get(cell)
        if not served:
            continue
        parts = [f"{r['server']:<12} {r['users']:>3} users: {cell} served {served:.1f} ms{_count(r, cell)}"]
        inp = by.get(("in-process-" + r["server"].removeprefix("ours-"), r["users"]))
        if inp and (ms := (inp.get("step_costs_ms") or {}).get(cell)):
            parts.append(f"in-process {ms:.1f} ms{_count(inp, cell)}: {served / ms:.2f}x")
        if bucket in alone:
            parts.append(f"alone {alone[bucket]:.1f} ms: {served / alone[bucket]:.2f}x")
        if len(parts) > 1:
            lines.append(", ".join(parts))
    return lines


def tree_rss_mb(pid: int) -> float | None:
    """Resident MiB of a process and every process under it."""
    try:
        import psutil

        root = psutil.Process(pid)
        return round(sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20, 1)
    except Exception:
        return None


def memory_line(health: dict) -> str:
    """Our replica's processes (its own and its engine's) against the engine's memory plan."""
    replica = health.get("replica") or {}
    plan = health.get("memory_plan") or {}
    engine, planned = replica.get("engine_rss_mb"), plan.get("predicted_rss_mb")
    ratio = f", {engine / planned:.2f}x the plan" if engine and planned else ""
    total = replica.get("rss_mb")
    return (f"replica's processes {total if total is None else round(total, 1)} MiB (engine process {engine} MiB, "
            f"planned {planned} MiB{ratio}: weights {plan.get('weights_mb')}, KV {plan.get('kv_cache_mb')}, "
            f"graphs {plan.get('graphs')})")


def _count(row: dict, cell: str) -> str:
    n = (row.get("step_forwards") or {}).get(cell)
    return f" ({n} forwards)" if n else ""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="in-process,ours,vllm", help="which to run, in this order")
    ap.add_argument("--users", default="1,4,16")
    ap.add_argument("--modes", default="auto,off", help="our server's lookahead modes")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", default="chat")
    ap.add_argument("--config", default="serve_config.yaml", help="our served config")
    ap.add_argument("--model", default=None,
                    help="a save_pretrained folder both servers load (ours: model.path, named after the folder)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per level (default: 6 per user, 12 at least; fewer for a slow model)")
    ap.add_argument("--history", choices=("on", "off"), default="off",
                    help="our replica's cross-request history and shared pool (off: nothing copied across requests)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override our served config's app args, e.g. --set torch_threads=2 --set engine.max_batch=8")
    ap.add_argument("--ours-url", default=None, help="a running server of ours (not started or stopped here)")
    ap.add_argument("--vllm-url", default=None, help="a running vLLM server (not started or stopped here)")
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--vllm-args", default="--max-model-len 1024 --max-num-seqs 16",
                    help="extra vLLM server arguments")
    ap.add_argument("--vllm-kv-gib", type=float, default=1.0,
                    help="vLLM's KV space (VLLM_CPU_KVCACHE_SPACE), GiB: the KV our served config's budget gives")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--ready-timeout", type=float, default=1200,
                    help="seconds for a server to be ready (ours: its graphs compiled, where none is stored, and timed)")
    ap.add_argument("--logs", default="results/bench_serving")
    ap.add_argument("--json", default=None)
    ap.add_argument("--in-process-only", default=None, help=argparse.SUPPRESS)  # the in-process phase's own process
    args = ap.parse_args(argv)
    users = [int(u) for u in args.users.split(",")]
    prompts = read_prompts(args.prompts)
    if args.in_process_only:
        app = yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"]
        in_rows = in_process(app, prompts, users, args.modes.split(","), args.max_tokens, args.requests)
        Path(args.in_process_only).write_text(json.dumps(in_rows))
        return {"rows": in_rows}
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    model_set = [f"model.path={Path(args.model).resolve()}", f"model.name={Path(args.model).name}"] if args.model else []
    config_path, app_args = served_config(args.config, args.history == "on", args.port, logs / "serve_config.yaml",
                                          [*model_set, *args.set])
    name = app_args.get("model", {}).get("name") or "SmolLM2-135M-Instruct"
    rows: list[dict] = []
    health: dict = {}
    for server in args.servers.split(","):
        proc = None
        if server == "in-process":  # a process of its own: the server started next gets the memory back
            out = logs / "in_process.json"
            subprocess.run([sys.executable, "-m", "benchmarks.bench_serving", "--in-process-only", str(out),
                            "--config", str(config_path), "--max-tokens", str(args.max_tokens),
                            "--prompts", args.prompts, "--users", args.users, "--modes", args.modes,
                            *(["--requests", str(args.requests)] if args.requests else [])], check=True)
            rows += json.loads(out.read_text())
            print(f"in-process (compiled, {rows[-1]['torch_threads']} torch threads): "
                  f"step_costs_ms={json.dumps({r['server'] + str(r['users']): r['step_costs_ms'] for r in rows})}", flush=True)
        elif server == "ours":
            url = args.ours_url or f"http://127.0.0.1:{args.port}"
            started = time.time()
            if args.ours_url is None:
                serve = str(Path(sys.executable).parent / "serve")
                proc = Server([serve, "run", str(config_path)], prepare(), logs / "ours.log")
            try:
                startup = ours_ready(url, args.ready_timeout, proc and proc.proc, started)
                health = requests.get(url + "/health", timeout=30).json()
                health["startup"] = startup
                graphs = health.get("compiled_decode", {}).get("buckets") or []
                print(f"ours: healthy {startup['healthy_s']} s after the start; every graph ready "
                      f"{startup['ready_after_healthy_s']} s after healthy, and timed alone {startup['timed_after_healthy_s']} s "
                      f"after ({sum(bool(b['cached']) for b in graphs)} of {len(graphs)} loaded from disk)", flush=True)
                name = health["model"]
                print(f"ours: model={health['model']} dtype={health['dtype']} cpu_capability={health['cpu_capability']} "
                      f"torch_threads={health['torch_threads']} history={args.history} "
                      f"core_plan={json.dumps(health.get('core_plan'))}", flush=True)
                print(f"ours, every graph ready: {memory_line(health)}", flush=True)
                print(HEADER, flush=True)
                for u in users:  # the modes side by side at each level: a host that drifts moves both
                    for mode in args.modes.split(","):
                        before = health_now(url).get("step_totals_ms", {})
                        rows += run_levels(url, f"ours-{mode}", prompts, [u], args.max_tokens, name, {"lookahead": mode},
                                           args.requests)
                        after_level = health_now(url).get("step_totals_ms", {})
                        rows[-1]["step_costs_ms"], rows[-1]["step_forwards"] = level_costs(before, after_level)
                after = health_now(url)
                print(f"ours after: step_costs_ms={json.dumps(after.get('step_costs_ms'))}", flush=True)
                print(f"ours after the levels: {memory_line(after)}", flush=True)
                health["after"] = after
            finally:
                if proc is not None:
                    proc.stop()
                    subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"],
                                   capture_output=True, env={**os.environ, **prepare()})
        elif server == "vllm":
            url = args.vllm_url or f"http://127.0.0.1:{args.port + 1}"
            dtype = health.get("dtype") or "float32"
            if args.vllm_url is None:
                cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", served_folder(app_args),
                       "--served-model-name", name, "--dtype", dtype, "--host", "127.0.0.1",
                       "--port", str(args.port + 1), *args.vllm_args.split()]
                print("vllm:", " ".join(cmd), flush=True)
                proc = Server(cmd, {"VLLM_CPU_KVCACHE_SPACE": f"{args.vllm_kv_gib:g}"}, logs / "vllm.log")
            try:
                wait_for(lambda url=url: requests.get(url + "/v1/models", timeout=10).status_code == 200,
                         args.ready_timeout, "vLLM", proc and proc.proc)
                print(f"vllm: dtype={dtype}", flush=True)
                print(HEADER, flush=True)
                rows += run_levels(url, "vllm", prompts, users, args.max_tokens, name, {}, args.requests)
                if proc is not None:
                    health["vllm_rss_mb"] = tree_rss_mb(proc.proc.pid)
                    print(f"vllm after the levels: its processes {health['vllm_rss_mb']} MiB", flush=True)
            finally:
                if proc is not None:
                    proc.stop()
        else:
            raise SystemExit(f"unknown server {server!r}: choose from in-process, ours, vllm")
    import torch

    print(f"\ncpu_capability={torch.backends.cpu.get_cpu_capability()} dtype={health.get('dtype')} "
          f"history={args.history} max_tokens={args.max_tokens} prompts={args.prompts} (each once per level)")
    print(HEADER)
    for r in rows:
        print(fmt(r) if "ttft" in r else f"{r['server']:<12} {r['users']:>5} {r['tokens_per_s']:>8.1f}")
    for line in ratios(rows):
        print(line)
    steps = served_steps(rows, health)
    if steps:
        print("one-token steps served, against in-process and alone:")
        for line in steps:
            print("  " + line)
    report = {"args": vars(args), "health": health, "rows": rows, "ratios": ratios(rows), "served_steps": steps}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

"""JSON-schema answers from this server and from vLLM's CPU server, the same weights on the same cores, one script run.

The tasks (benchmarks/prompts/json_schema_tasks.jsonl: an instruction, a JSON schema with nesting,
arrays, enums, numbers, booleans, bounded strings and a few free ones, and a valid example) are
sent by one user, one at a time, to `/v1/chat/completions` with `response_format: {"type":
"json_schema", "json_schema": {"name", "schema", "strict": true}}`, greedy, streamed with the usage
chunk through the load client (`loadtests/client.py`), so TTFT and TPOT read as in bench_serving.
Ours runs each task in every mode of `--modes` back to back (`"auto"` and `"off"`, the request's
`lookahead` field; `chat`: the same prompt without `response_format`, `"auto"`, the unconstrained
figure beside it), then vLLM runs each once. Servers are started as bench_serving starts them
(its helpers: our `serve run` of the served config, history off by default; vLLM's OpenAI server
on our dequantized weights in our dtype), one after the other, never both at once. Before the
timed runs each task's schema is sent once with `max_tokens` 1, so every server has built its
grammar and the timed answers decode. vLLM runs as shipped: its grammar leaves whitespace between
JSON tokens to the model (ours fixes ", " and ": "), unless `--vllm-args` adds
`--structured-outputs-config {"disable_any_whitespace":true}` (no spaces: the arguments are split on them).

    bash benchmarks/setup_vllm.sh .venv-vllm                # vLLM's CPU server, once (make bench-serving runs it)
    python -m benchmarks.bench_structured                   # ours, then vLLM: results/bench_structured.json
    python -m benchmarks.bench_structured --servers ours --ours-url http://127.0.0.1:8000 --modes auto,off

Each answer is scored: ended by itself (finish_reason "stop") or cut at `max_tokens` ("length": the
small model looping, mostly inside a free string), parses as JSON, validates against its schema
(jsonschema, draft 2020-12). tok/s is completion tokens over the time the requests took (the
gaps between them, where /health is read, left out); tokens per step is ours only: from the
response's `lookahead` summary where the stream carries one, else from /health's decode forwards
around each request (one user: every forward was its own), plus one for its first token, as the
engine counts steps.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests
from jsonschema import Draft202012Validator

from benchmarks.bench_serving import Server, health_now, ours_ready, served_config, served_folder, tree_rss_mb, wait_for
from deployments.ray_env import prepare
from loadtests.client import Outcome, chat_body, generate, percentiles
from lookahead_core.serving import sse

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "benchmarks" / "prompts" / "json_schema_tasks.jsonl"
ROUTE = "/v1/chat/completions"
CHAT = "chat"  # the mode that sends no response_format, "auto"


def read_tasks(path: str | Path = TASKS, names: list[str] | None = None) -> list[dict]:
    """The tasks of a JSONL file ({"name", "prompt", "schema", "example"} per line), those of `names` only where given."""
    tasks = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if names:
        missing = set(names) - {t["name"] for t in tasks}
        if missing:
            raise SystemExit(f"no task named {', '.join(sorted(missing))} in {path}")
        tasks = [t for t in tasks if t["name"] in names]
    return tasks


def response_format(task: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": task["name"], "schema": task["schema"], "strict": True}}


def score(text: str, finish: str | None, schema: dict) -> dict:
    """One answer: how it ended, whether it parses, whether it validates (the first error where not)."""
    out: dict[str, Any] = {"finish": finish, "ended": finish == "stop", "looped": finish == "length",
                           "parses": False, "valid": False, "error": None}
    try:
        value = json.loads(text)
    except ValueError as exc:
        out["error"] = f"does not parse: {exc}"
        return out
    out["parses"] = True
    errors = sorted(Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.absolute_path))
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path)
        out["error"] = f"invalid at /{where}: {errors[0].message}"
    out["valid"] = not errors
    return out


class _Tap(requests.Session):
    """A session that keeps every line of the streams it reads, so the load client's timing stays
    the only timing and the answer's text is read from the same lines afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[bytes] = []

    def post(self, *args, **kwargs):  # type: ignore[override]
        response = super().post(*args, **kwargs)
        read = response.iter_lines

        def iter_lines(*a, **kw):
            for line in read(*a, **kw):
                self.lines.append(line)
                yield line
        response.iter_lines = iter_lines  # type: ignore[method-assign]
        return response


def answer(lines: list[bytes]) -> tuple[str, str | None, dict | None]:
    """A chat stream's text, finish reason and `lookahead` summary (where a chunk carries one)."""
    text, finish, summary = [], None, None
    for event in sse.events(lines):
        if event == sse.DONE or "error" in event:
            break
        summary = event.get("lookahead") or summary
        for choice in event.get("choices") or ():
            text.append((choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    return "".join(text), finish, summary


def ask(url: str, body: dict, timeout_s: float = 600) -> tuple[Outcome, str, str | None, dict | None]:
    """One streamed chat request, timed by the load client; its outcome, text, finish reason, summary."""
    with _Tap() as tap:
        out = generate(url, body, timeout_s, session=tap, route=ROUTE)
        return (out, *answer(tap.lines))


def forwards(totals: dict) -> int:
    """Decode forwards run so far, from /health's `step_totals_ms` ({cell: [ms, count]})."""
    return sum(n for _, n in totals.values())


class ForwardCount:
    """Our engine's decode forwards, read fresh from /health; `take` gives those run since the last read."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen = self.read()

    def read(self) -> int:
        return forwards(health_now(self.url).get("step_totals_ms") or {})

    def take(self) -> int:
        now = self.read()
        taken, self.seen = now - self.seen, now
        return taken


def run_task(url: str, task: dict, mode: str | None, model: str, max_tokens: int, count: ForwardCount | None = None) -> dict:
    """One task once: `mode` is ours' lookahead mode (None for vLLM; CHAT: no response_format, "auto");
    with `count`, our decode forwards over it (one user: every one was its own)."""
    extra: dict[str, Any] = {} if mode == CHAT else {"response_format": response_format(task)}
    if mode is not None:
        extra["lookahead"] = "auto" if mode == CHAT else mode
    out, text, finish, summary = ask(url, chat_body(task["prompt"], max_tokens=max_tokens, model=model, **extra))
    taken = count.take() if count is not None else None
    row: dict[str, Any] = {"task": task["name"], "ok": out.ok, "error": out.error, "tokens": out.tokens,
                           "latency_s": out.latency, "ttft_s": out.ttft, "tpot_s": out.tpot, "text": text}
    if out.ok and summary and summary.get("steps"):
        row["steps"], row["steps_from"] = summary["steps"], "summary"
    elif out.ok and taken is not None:
        row["steps"], row["steps_from"] = taken + 1, "health"  # the first token's step was the prefill's
    if out.ok:
        row.update(score(text, finish, task["schema"]) if mode != CHAT else
                   {"finish": finish, "ended": finish == "stop", "looped": finish == "length"})
    return row


def warm(url: str, tasks: list[dict], model: str, extra: dict) -> None:
    """Each schema once with one token (its grammar built), and two plain requests (a fresh process's one-off costs)."""
    for task in tasks:
        generate(url, chat_body(task["prompt"], max_tokens=1, model=model, response_format=response_format(task), **extra),
                 route=ROUTE)
    for task in tasks[:2]:
        generate(url, chat_body(task["prompt"], max_tokens=8, model=model, **extra), route=ROUTE)


def summarize(run: str, results: list[dict]) -> dict:
    """One run's figures over its tasks."""
    done = [r for r in results if r["ok"]]
    busy = sum(r["latency_s"] for r in done)
    tokens = sum(r["tokens"] for r in done)
    row: dict[str, Any] = {"run": run, "requests": len(done), "errors": len(results) - len(done),
                           "error_samples": [r["error"] for r in results if not r["ok"]][:3], "tokens": tokens,
                           "busy_s": round(busy, 2), "tokens_per_s": round(tokens / busy, 2) if busy else 0.0}
    for name in ("ttft", "tpot", "latency"):
        p = percentiles([r[f"{name}_s"] for r in done], (50, 95))
        row[name] = {k: None if v is None else round(1000 * v, 1) for k, v in p.items()}  # ms
    for key in ("ended", "looped", "parses", "valid"):
        row[key] = sum(bool(r.get(key)) for r in done)
    row["ended_invalid"] = sum(bool(r.get("ended") and not r.get("valid")) for r in done)
    steps = [r for r in done if r.get("steps")]
    row["tokens_per_step"] = round(sum(r["tokens"] for r in steps) / sum(r["steps"] for r in steps), 3) if steps else None
    row["steps_from"] = sorted({r["steps_from"] for r in steps}) or None
    return row


HEADER = (f"{'run':<10} {'tok/s':>7} {'tok/step':>8} {'TTFT p50':>8} {'TPOT p50':>8} {'e2e p50':>8} {'tokens':>6} "
          f"{'valid':>5} {'parses':>6} {'ended':>5} {'looped':>6} {'errors':>6}   (ms; valid, ended, looped: answers)")


def fmt(r: dict, n: int) -> str:
    tps = "-" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
    structured = r["run"] != f"ours-{CHAT}"
    counts = (f"{r['valid']:>2}/{n:<2} {r['parses']:>6} {r['ended']:>5} {r['looped']:>6}" if structured
              else f"{'-':>5} {'-':>6} {r['ended']:>5} {r['looped']:>6}")
    return (f"{r['run']:<10} {r['tokens_per_s']:>7.1f} {tps:>8} {r['ttft']['p50']:>8} {r['tpot']['p50']:>8} "
            f"{r['latency']['p50']:>8} {r['tokens']:>6} {counts} {r['errors']:>6}")


def _timed(rows: dict[str, dict], run: str) -> dict | None:
    """The run's figures where it has some to divide by (every request of it answered: none)."""
    r = rows.get(run)
    return r if r and r["requests"] and r["tokens_per_s"] > 0 else None


def ratios(rows: dict[str, dict], tasks: int) -> list[str]:
    """Ours against vLLM and auto against off, from this run's figures."""
    a, o, c, v = (_timed(rows, k) for k in ("ours-auto", "ours-off", f"ours-{CHAT}", "vllm"))
    lines = []
    if a and o:
        lines.append(f"auto/off tok/s {a['tokens_per_s'] / o['tokens_per_s']:.2f}x")
    if a and v:
        lines.append(f"auto/vLLM tok/s {a['tokens_per_s'] / v['tokens_per_s']:.2f}x, e2e p50 "
                     f"{a['latency']['p50'] / v['latency']['p50']:.2f}x, TTFT p50 {a['ttft']['p50'] / v['ttft']['p50']:.2f}x")
    if o and v:
        lines.append(f"off/vLLM tok/s {o['tokens_per_s'] / v['tokens_per_s']:.2f}x")
    valid = [f"{k} {r['valid']}/{tasks}" for k, r in rows.items() if k != f"ours-{CHAT}"]
    if valid:
        lines.append("valid: " + ", ".join(valid))
    if a and c and a["tokens_per_step"] and c["tokens_per_step"]:
        lines.append(f"tokens per step, auto: schema tasks {a['tokens_per_step']:.2f}, the same prompts as plain chat "
                     f"{c['tokens_per_step']:.2f}")
    return lines


def identical(results: dict[str, list[dict]]) -> str | None:
    """How many tasks ours answered alike in "auto" and "off" (greedy: lookahead keeps the text, up to
    bfloat16's near-ties between step shapes)."""
    a, o = results.get("ours-auto"), results.get("ours-off")
    if not a or not o:
        return None
    same = sum(x["ok"] and y["ok"] and x["text"] == y["text"] for x, y in zip(a, o))
    return f"auto and off answers identical: {same}/{len(a)}"


def checks(rows: dict[str, dict], tasks: int) -> list[str]:
    """The issue's bars, each with what this run read."""
    out = []
    ours = [r for k, r in rows.items() if k.startswith("ours-") and k != f"ours-{CHAT}"]
    if ours:
        bad = sum(r["ended_invalid"] for r in ours)
        out.append(f"{'PASS' if bad == 0 else 'FAIL'} every answer of ours that ended by itself validates "
                   f"({bad} did not, over {', '.join(r['run'] for r in ours)})")
    a, o, v = (_timed(rows, k) for k in ("ours-auto", "ours-off", "vllm"))
    if v:
        for r in ours:
            out.append(f"{'PASS' if r['valid'] >= v['valid'] else 'FAIL'} {r['run']} valid {r['valid']}/{tasks} "
                       f">= vLLM's {v['valid']}/{tasks}")
    if a and o:
        x = a["tokens_per_s"] / o["tokens_per_s"]
        out.append(f"{'PASS' if x >= 1.3 else 'FAIL'} auto/off tok/s {x:.2f}x >= 1.3x")
    if a and v:
        x = a["tokens_per_s"] / v["tokens_per_s"]
        out.append(f"{'PASS' if x >= 2.5 else 'FAIL'} auto/vLLM tok/s {x:.2f}x >= 2.5x")
    for k, r in rows.items():
        if k != f"ours-{CHAT}":
            out.append(f"looped to max_tokens: {k} {r['looped']}/{tasks}")
    return out


def per_task(results: dict[str, list[dict]], tasks: list[dict]) -> list[str]:
    """Each task: each run's finish, validity, tokens, tokens per step, and where it went wrong."""
    lines = []
    for i, task in enumerate(tasks):
        parts = [f"{task['name']:<20}"]
        for run, rs in results.items():
            r = rs[i]
            if not r["ok"]:
                parts.append(f"{run}: error")
                continue
            verdict = "" if run == f"ours-{CHAT}" else (" valid" if r.get("valid") else " INVALID")
            steps = f" {r['tokens'] / r['steps']:.2f}/step" if r.get("steps") else ""
            parts.append(f"{run}: {r.get('finish')}{verdict} {r['tokens']} tok{steps}")
        lines.append("  ".join(parts))
        for run, rs in results.items():
            r = rs[i]
            if r["ok"] and r.get("error"):
                lines.append(f"    {run}: {r['error'][:120]}; ends ...{r['text'][-60:]!r}")
    return lines


@contextlib.contextmanager
def ours_server(args: argparse.Namespace, config_path: Path, logs: Path) -> Iterator[tuple[str, dict]]:
    """Our server as bench_serving starts it (`serve run` of the served config, ready when every
    graph is ready and timed), or the running one at --ours-url; its /health."""
    url = args.ours_url or f"http://127.0.0.1:{args.port}"
    started, proc = time.time(), None
    if args.ours_url is None:
        proc = Server([str(Path(sys.executable).parent / "serve"), "run", str(config_path)], prepare(), logs / "ours.log")
    try:
        startup = ours_ready(url, args.ready_timeout, proc and proc.proc, started)
        yield url, {**requests.get(url + "/health", timeout=30).json(), "startup": startup}
    finally:
        if proc is not None:
            proc.stop()
            subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True,
                           env={**os.environ, **prepare()})


@contextlib.contextmanager
def vllm_server(args: argparse.Namespace, app_args: dict, name: str, dtype: str, logs: Path) -> Iterator[tuple[str, Any]]:
    """vLLM's OpenAI server as bench_serving starts it (our dequantized weights, our dtype), or the running one at --vllm-url."""
    url = args.vllm_url or f"http://127.0.0.1:{args.port + 1}"
    proc = None
    if args.vllm_url is None:
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", served_folder(app_args),
               "--served-model-name", name, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(args.port + 1),
               *args.vllm_args.split()]
        print("vllm:", " ".join(cmd), flush=True)
        proc = Server(cmd, {"VLLM_CPU_KVCACHE_SPACE": f"{args.vllm_kv_gib:g}"}, logs / "vllm.log")
    try:
        wait_for(lambda: requests.get(url + "/v1/models", timeout=10).status_code == 200, args.ready_timeout, "vLLM",
                 proc and proc.proc)
        yield url, proc
    finally:
        if proc is not None:
            proc.stop()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="ours,vllm", help="which to run, in this order")
    ap.add_argument("--modes", default=f"auto,off,{CHAT}",
                    help=f"our server's lookahead modes, each task in each back to back ({CHAT}: no response_format, auto)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tasks", default=str(TASKS), help="a tasks JSONL file")
    ap.add_argument("--only", default=None, help="task names, comma-separated (default: every task)")
    ap.add_argument("--config", default="serve_config.yaml", help="our served config")
    ap.add_argument("--history", choices=("on", "off"), default="off",
                    help="our replica's cross-request history and shared pool (off: no mode copies another's answer)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override our served config's app args")
    ap.add_argument("--ours-url", default=None, help="a running server of ours (not started or stopped here)")
    ap.add_argument("--vllm-url", default=None, help="a running vLLM server (not started or stopped here)")
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--vllm-args", default="--max-model-len 1024 --max-num-seqs 16", help="extra vLLM server arguments")
    ap.add_argument("--vllm-kv-gib", type=float, default=1.0, help="vLLM's KV space (VLLM_CPU_KVCACHE_SPACE), GiB")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--ready-timeout", type=float, default=1200)
    ap.add_argument("--logs", default="results/bench_structured")
    ap.add_argument("--out", default="results/bench_structured.json", help="the JSON result")
    args = ap.parse_args(argv)
    tasks = read_tasks(args.tasks, args.only.split(",") if args.only else None)
    modes = args.modes.split(",")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    config_path, app_args = served_config(args.config, args.history == "on", args.port, logs / "serve_config.yaml", args.set)
    name = app_args.get("model", {}).get("name") or "SmolLM2-135M-Instruct"
    results: dict[str, list[dict]] = {}
    health: dict = {}
    for server in args.servers.split(","):
        if server == "ours":
            with ours_server(args, config_path, logs) as (url, health):
                name = health["model"]
                print(f"ours: model={name} dtype={health['dtype']} cpu_capability={health['cpu_capability']} "
                      f"torch_threads={health['torch_threads']} history={args.history} healthy {health['startup']['healthy_s']} s "
                      f"after the start, every graph timed {health['startup']['timed_after_healthy_s']} s after", flush=True)
                warm(url, tasks, name, {"lookahead": "auto"})
                count = ForwardCount(url)
                for task in tasks:  # the modes back to back on each task: a host that drifts moves them alike
                    for mode in modes:
                        results.setdefault(f"ours-{mode}", []).append(run_task(url, task, mode, name, args.max_tokens, count))
                    print(f"ours: {task['name']} done", flush=True)
        elif server == "vllm":
            dtype = health.get("dtype") or "float32"
            with vllm_server(args, app_args, name, dtype, logs) as (url, proc):
                print(f"vllm: dtype={dtype}", flush=True)
                warm(url, tasks, name, {})
                results["vllm"] = [run_task(url, t, None, name, args.max_tokens) for t in tasks]
                if proc is not None:
                    health["vllm_rss_mb"] = tree_rss_mb(proc.proc.pid)
        else:
            raise SystemExit(f"unknown server {server!r}: choose from ours, vllm")
    import torch

    rows = {run: summarize(run, rs) for run, rs in results.items()}
    print(f"\ncpu_capability={torch.backends.cpu.get_cpu_capability()} dtype={health.get('dtype')} history={args.history} "
          f"max_tokens={args.max_tokens} tasks={len(tasks)} ({Path(args.tasks).name}), one user, greedy, each task once per run")
    print(HEADER)
    for r in rows.values():
        print(fmt(r, len(tasks)))
    lines = ratios(rows, len(tasks)) + [line for line in [identical(results)] if line]
    verdicts = checks(rows, len(tasks))
    for line in [*lines, *verdicts]:
        print(line)
    print("per task:")
    for line in per_task(results, tasks):
        print("  " + line)
    report = {"args": vars(args), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "health": health,
              "rows": list(rows.values()), "ratios": lines, "checks": verdicts, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

"""Streaming /generate users; TTFT, per-token TPOT, end-to-end latency and output tokens/s as
locust entries; SLO verdict at quit (exit code 1 on a breach).

    locust -f loadtests/locustfile.py --headless -u 8 -r 2 -t 60s --host http://127.0.0.1:8000 \\
        --slo-file loadtests/slo.yaml --prompt-set code --lookahead auto

LOOKAHEAD_SHAPE=step|spike|soak picks a load shape from loadtests/shapes.py (it overrides -u/-r/-t).
"""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from locust import HttpUser, constant, events, task

from loadtests.client import (
    REQUEST_KINDS,
    Outcome,
    generate_body,
    lookahead_field,
    parse_mix,
    percentiles,
    read_openai_stream,
    read_prompts,
    read_stream,
    route_for,
)
from loadtests.slo import ENTRIES, PERCENTILES, SloConfig, table, verdict

if os.environ.get("LOOKAHEAD_SHAPE"):
    from loadtests.shapes import SHAPES

    globals()[SHAPES[os.environ["LOOKAHEAD_SHAPE"]].__name__] = SHAPES[os.environ["LOOKAHEAD_SHAPE"]]

ROOT = Path(__file__).resolve().parent.parent
RUN: dict = {"mix": {}, "compression": [], "steps": 0, "tokens": 0, "met_slo": 0, "values": {e: [] for e in ENTRIES},
       "by_kind": {}}  # with --mix: {request kind: {entry: [values]}}
LIMITS: dict[str, float] = {}


@events.test_start.add_listener
def _limits(environment, **_kwargs) -> None:
    """Per-request bounds for goodput: each entry's tail bound (the highest percentile given)."""
    cfg = SloConfig.load(environment.parsed_options.slo_file)
    for entry, slo in cfg.entries.items():
        bound = next((v for v in (slo.p99, slo.p95, slo.p90, slo.p50) if v is not None), None)
        if bound is not None:
            LIMITS[entry] = bound


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--slo-file", default=str(ROOT / "loadtests" / "slo.yaml"))
    parser.add_argument("--prompt-set", default="code", help="code | text | a JSONL path")
    parser.add_argument("--lookahead", default="auto", help='auto | off | "n,w,g"')
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mix", default="", help='kinds of request by weight, e.g. "off=4,fixed=1,top_p=1,stop=1" '
                                                  f"(kinds: {', '.join(REQUEST_KINDS)}); overrides --lookahead")
    parser.add_argument("--summary-json", default="", help="write figures and verdict here")


def _record(environment, name: str, value: float) -> None:
    """Into locust's own stats (its web UI and CSVs, which round to whole ms) and, exact, into the SLO figures."""
    RUN["values"][name].append(value)
    environment.events.request.fire(request_type="METRIC", name=name, response_time=value, response_length=0, exception=None, context={})


class GenerateUser(HttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.prompts = read_prompts(opts.prompt_set)
        self.lookahead = lookahead_field(opts.lookahead)
        self.max_new = opts.max_new_tokens
        self.rng = random.Random()
        self.mix = parse_mix(opts.mix) if opts.mix else None

    @task
    def generate(self) -> None:
        body = generate_body(self.rng.choice(self.prompts), chat=False, max_new_tokens=self.max_new, lookahead=self.lookahead)
        kind = None
        if self.mix is not None:
            kind = self.rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
            body.update(REQUEST_KINDS[kind])
        path, body = route_for(body)
        read = read_stream if path == "/generate" else read_openai_stream
        out = Outcome(start=time.perf_counter())
        with self.client.post(path, json=body, stream=True, catch_response=True, name="generate") as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            read(out, resp.iter_lines(), clock=time.perf_counter)
            if out.error is not None or out.first is None:  # e.g. the replica died mid-stream
                resp.failure(f"stream: {out.error}" if out.error else "the stream ended without tokens")
                return
            resp.success()
        env = self.environment
        measured = {"ttft": 1000 * out.ttft, "e2e": 1000 * out.latency}
        if out.tpot is not None:
            measured["tpot"] = 1000 * out.tpot
        for name, value in measured.items():
            _record(env, name, value)
            if kind is not None:
                RUN["by_kind"].setdefault(kind, {}).setdefault(name, []).append(value)
        _record(env, "output_tokens_per_s", out.tokens / out.latency)
        RUN["met_slo"] += all(measured.get(k, 0.0) <= v for k, v in LIMITS.items())
        la = out.summary.get("lookahead") or {"steps": 0, "compression": None}  # an OpenAI stream has none
        for kind, steps in la.get("steps_by_kind", {}).items():  # what the engine's planner ran
            RUN["mix"][kind] = RUN["mix"].get(kind, 0) + steps
        if la["compression"]:
            RUN["compression"].append(la["compression"])
        RUN["steps"] += la["steps"]
        RUN["tokens"] += out.tokens


def figures(environment) -> dict[str, dict[str, float]]:
    """Each entry's count and percentiles from the exact measured values (locust's histogram keeps
    whole milliseconds: a 0.4 ms TPOT would read 0 and meet any bound)."""
    out = {}
    for entry in ENTRIES:
        values = RUN["values"][entry]
        if values:
            exact = percentiles(values, [round(q * 100) for q in PERCENTILES])
            out[entry] = {"count": len(values), **{k: float(v) for k, v in exact.items() if v is not None}}
    return out


@events.quitting.add_listener
def _verdict(environment, **_kwargs) -> None:
    opts = environment.parsed_options
    cfg = SloConfig.load(opts.slo_file)
    figs = figures(environment)
    gen = environment.stats.get("generate", "POST")
    error_rate = gen.num_failures / gen.num_requests if gen.num_requests else 0.0
    completed = gen.num_requests - gen.num_failures
    breaches = verdict(cfg, figs, completed, error_rate)
    print("\n" + table(cfg, figs))
    print(f"requests {gen.num_requests}, failures {gen.num_failures}; steps by kind {RUN['mix']}")
    print("SLO: " + ("met" if not breaches else "BREACHED: " + "; ".join(breaches)))
    if opts.summary_json:
        compression = sorted(RUN["compression"])
        Path(opts.summary_json).write_text(json.dumps({
            "figures": figs, "requests": gen.num_requests, "failures": gen.num_failures, "error_rate": error_rate,
            "duration_s": environment.stats.last_request_timestamp - environment.stats.start_time if gen.num_requests else 0,
            "tokens": RUN["tokens"], "steps": RUN["steps"], "mix": RUN["mix"], "met_slo": RUN["met_slo"],
            "compression_p50": compression[len(compression) // 2] if compression else None,
            "breaches": breaches,
            "by_kind": {kind: {entry: {"count": len(v), **percentiles(v, [50, 95, 99])} for entry, v in entries.items()}
                        for kind, entries in RUN["by_kind"].items()},
        }, indent=1))
    if breaches:
        environment.process_exit_code = 1

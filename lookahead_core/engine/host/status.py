"""What an engine reports of itself (the replica's `/health`), read on the thread that steps it."""
from __future__ import annotations

import os

from lookahead_core.engine.engine import Engine
from lookahead_core.engine.graphs.decode_graphs import DecodeGraphs


def rss_mb() -> float | None:
    """This process's resident memory, MiB."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def health_status(error: str | None, status: dict) -> str:
    """The replica's status from its engine's health error and last status: "failing" (it cannot
    step), "degraded" (a compiled graph failed: its steps run eagerly, slower) or "ok"."""
    if error is not None:
        return "failing"
    return "degraded" if status.get("compiled_decode", {}).get("failed") else "ok"


def step_time(engine: Engine) -> dict:
    """Mean milliseconds per engine step: in decode forwards, in prefill forwards, and on the host
    (planning, masks, verification: the rest of the step), over the engine's life."""
    steps = max(engine.steps, 1)
    host = engine.step_s - engine.forward_s - engine.prefill_s
    return {"steps": engine.steps, "forward": round(1000 * engine.forward_s / steps, 3),
            "prefill": round(1000 * engine.prefill_s / steps, 3), "host": round(1000 * host / steps, 3)}


def graphs_status(graphs: DecodeGraphs) -> list[dict]:
    """Every graph: its shape, whether it runs, its compile (or load) seconds, whether it came
    from the store, its calls, and what its steps cost alone per "b<batch>t<width>"."""
    return [{"batch": b.batch, "width": b.width, "kv": b.kv, **({"prefill": True} if b.prefill else {}),
             "dynamic": b.dynamic, "ready": b in graphs.ready,
             "compile_s": None if g.compile_s is None else round(g.compile_s, 1), "cached": g.cached,
             "code_mb": round(g.code_bytes / 2**20, 1), "calls": g.calls,
             "alone_ms": {f"b{bb}t{w}": ms for (bb, w), ms in sorted(g.alone_ms.items())},
             "timed_alone": b in graphs.ready and not g.untimed,
             **({"error": graphs.failed[b]} if b in graphs.failed else {})}
            for b, g in list(graphs.graphs.items())]


def graph_status(engine: Engine) -> list[dict]:
    """The compiled graphs (`DecodeGraphs.status`), each decode graph with what the steps it
    runs cost served, per "b<batch>t<width>"."""
    graphs = engine.runner.graphs
    if graphs is None:
        return []
    served = engine.runner.costs.table()
    return [{**b, "served_ms": {} if b.get("prefill") else served} for b in graphs_status(graphs)]


def engine_status(engine: Engine) -> dict:
    compiled = engine.runner.graphs
    prefixes = engine.runner.prefixes
    return {
        "engine": {"pid": os.getpid(), "rss_mb": rss_mb(), "steps": engine.steps, "aborted_requests": engine.aborted},
        "kv_cache": {**engine.kv_plan.as_dict(), "max_seq_len": engine.max_seq_len},
        "weights": engine.runner.weights.as_dict(),
        "memory_plan": engine.memory.as_dict(),
        "auto_lookahead": engine.config.lookahead.label,
        "history": engine.knowledge.status(),
        "prefix_cache": None if prefixes is None else prefixes.status(),
        "step_costs_ms": engine.runner.costs.table(),
        "step_totals_ms": engine.runner.costs.totals(),
        "step_time_ms": step_time(engine),
        "compiled_decode": {"mode": engine.config.compile, "buckets": graph_status(engine),
                            "ready": compiled is not None and len(compiled.ready) == len(compiled.graphs),
                            "timed": compiled is not None and len(compiled.ready) == len(compiled.graphs)
                            and compiled.timed,
                            "eager_forwards": engine.runner.eager_forwards if compiled else None,
                            "graph_failures": compiled.graph_failures if compiled else None,
                            # graphs that failed (to compile, check or run): their steps run eagerly
                            "failed": len(compiled.failed) if compiled else 0},
    }

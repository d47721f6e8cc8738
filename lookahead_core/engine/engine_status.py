"""What an engine reports of itself (the replica's `/health`), read on the thread that steps it."""
from __future__ import annotations

import os

from lookahead_core.engine.engine import Engine


def rss_mb() -> float | None:
    """This process's resident memory, MiB."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def step_time(engine: Engine) -> dict:
    """Mean milliseconds per engine step: in decode forwards, in prefill forwards, and on the host
    (planning, masks, verification: the rest of the step), over the engine's life."""
    steps = max(engine.steps, 1)
    host = engine.step_s - engine.forward_s - engine.prefill_s
    return {"steps": engine.steps, "forward": round(1000 * engine.forward_s / steps, 3),
            "prefill": round(1000 * engine.prefill_s / steps, 3), "host": round(1000 * host / steps, 3)}


def engine_status(engine: Engine) -> dict:
    compiled = engine.compiled
    return {
        "engine": {"pid": os.getpid(), "rss_mb": rss_mb(), "steps": engine.steps, "aborted_requests": engine.aborted},
        "kv_cache": {**engine.kv_plan.as_dict(), "max_seq_len": engine.max_seq_len},
        "weights": engine.runner.weights.as_dict(),
        "memory_plan": engine.memory.as_dict(),
        "auto_lookahead": engine.config.lookahead.label,
        "history": engine.knowledge.status(),
        "prefix_cache": None if engine.prefixes is None else engine.prefixes.status(),
        "step_costs_ms": engine.runner.costs.table(),
        "step_totals_ms": engine.runner.costs.totals(),
        "step_time_ms": step_time(engine),
        "compiled_decode": {"mode": engine.config.compile, "buckets": engine.compile_status(),
                            "ready": compiled is not None and len(compiled.ready) == len(compiled.graphs),
                            "timed": compiled is not None and len(compiled.ready) == len(compiled.graphs)
                            and compiled.timed,
                            "eager_forwards": engine.runner.eager_forwards if compiled else None,
                            "graph_failures": compiled.graph_failures if compiled else None},
    }

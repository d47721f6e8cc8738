"""What each ready graph's steps cost alone: timed on the engine's thread while it has no request,
one call a turn, for the planner's prices."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lookahead_core.engine.graphs.buckets import cheapest

if TYPE_CHECKING:
    from lookahead_core.engine.graphs.decode_graphs import DecodeGraphs

TIMED_CALLS = 3  # a cell's cost alone: the fastest of these calls, after one untimed


def time_pending(graphs: DecodeGraphs, pending: Callable[[], bool] = lambda: False) -> bool:
    """One call of a ready graph not yet timed alone, on the calling thread (the engine's, while
    it has no request), toward its next cell: `TIMED_CALLS` all-padding calls after an untimed
    one, the fastest its cost alone. One call a turn, so a command that arrives waits for one
    call at most and the cell goes on at the next idle turn. True if a call ran."""
    g = next((g for g in graphs.graphs.values() if g.bucket in graphs.ready and g.untimed), None)
    if g is None or g.run is None or pending():
        return False
    batch, width = cell = g.untimed[0]
    if graphs.threads is not None:
        graphs.threads.use(batch, g.bucket.prefill)
    with torch.inference_mode():
        g.staging.pad(batch, width, min(256, graphs.scratch))
        t0 = time.perf_counter()
        g.run(g.staging.inputs())
        if graphs.cuda:
            torch.cuda.synchronize(graphs.device)
        ms = (time.perf_counter() - t0) * 1000.0
    times = g.timing.setdefault(cell, [])
    times.append(ms)
    if len(times) > TIMED_CALLS:
        g.alone_ms[cell] = round(min(times[1:]), 3)
        g.untimed.pop(0)
        del g.timing[cell]
        graphs.changes += 1
    return True


def alone_costs(graphs: DecodeGraphs) -> dict[int, dict[int, float]]:
    """{batch: {width: ms}}: what a step of each timed cell costs alone in the ready decode
    graph that runs it."""
    table: dict[int, dict[int, float]] = {}
    for b in graphs.ready:
        if b.prefill:
            continue
        for (batch, width), ms in graphs.graphs[b].alone_ms.items():
            if cheapest(graphs.ready, batch, width, min(256, graphs.scratch)) == b:
                table.setdefault(batch, {})[width] = ms
    return table

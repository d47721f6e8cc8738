"""An engine's shape before anything is allocated: its KV slots, the graphs it compiles and the
memory plan they make together, refused at start where they cannot fit."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.graphs.buckets import Bucket
from lookahead_core.engine.runner.memory_plan import (
    COMPILE_WORKSPACE_BYTES,
    GRAPH_CODE_BYTES,
    ONEDNN_CACHE_BYTES,
    KVPlan,
    MemoryPlan,
    free_memory,
    plan_kv,
    process_rss,
)
from lookahead_core.engine.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sizing:
    """The slots of `kv` (each `capacity` tokens: the longest sequence plus one step's rows), the
    prompt chunk, the graphs to compile and the memory plan."""

    kv: KVPlan
    memory: MemoryPlan
    buckets: list[Bucket]
    capacity: int
    chunk: int


def graph_buckets(cfg: EngineConfig, device_type: str, slots: int, capacity: int, chunk: int) -> list[Bucket]:
    """On CPU one decode graph of every batch and width up to compile_max_width, and one for
    prompt chunks (`compile_prefill`); on CUDA the fixed shapes of compile_buckets; none with
    compile off."""
    if cfg.compile == "off":
        return []
    if device_type == "cpu":
        out = [Bucket(slots, min(cfg.compile_max_width, cfg.max_step_tokens), capacity - 1)]
        if cfg.compile_prefill and chunk > 1:
            out.append(Bucket(1, chunk, capacity - 1, prefill=True))
        return out
    fitted = cfg.buckets_within(slots)
    over = sorted({batch for batch, _ in cfg.compile_buckets if batch > slots})
    if over:
        log.warning("engine.compile_buckets batch %s exceeds the %d KV slots of the plan: compiled as batch %d",
                    ", ".join(map(str, over)), slots, slots)
    kvs = sorted({min(kv, capacity) for kv in cfg.compile_kv}) or [capacity]
    return [Bucket(b, w, kv, dynamic=False) for b, w in fitted for kv in kvs]


def memory_plan(runner: ModelRunner, cfg: EngineConfig, process: int, kv: KVPlan, slots: int, capacity: int,
                chunk: int, buckets: list[Bucket], learned_bytes: int) -> MemoryPlan:
    """What the process holds with `kv` and the buffers of `slots`, every graph of `buckets` ready."""
    item = runner.dtype.itemsize
    buffers = (3 * slots * cfg.max_step_tokens * 8  # step ids, positions, KV columns
               + chunk * capacity * item + chunk * chunk * item  # the prefill mask and its causal block
               + sum(b.batch * b.width * (min(b.kv, capacity - 1) * item + 24) for b in buckets))  # graph inputs
    widest = max((b.batch * b.width for b in buckets if not b.prefill), default=slots * cfg.max_step_tokens)
    compiling = runner.device.type == "cpu" and cfg.compile != "off"
    onednn = runner.weights.layout == "onednn"
    return MemoryPlan(process, runner.weights.bytes, kv, buffers, learned_bytes, len(buckets),
                      len(buckets) * GRAPH_CODE_BYTES, widest * runner.vocab_size * item,
                      # a worker packs its own uninitialised copy of the weights for oneDNN
                      COMPILE_WORKSPACE_BYTES + (runner.weights.bytes if onednn else 0) if compiling else 0,
                      min(cfg.compile_workers, len(buckets)) if compiling else 0,
                      ONEDNN_CACHE_BYTES if onednn else 0)


def size_engine(runner: ModelRunner, cfg: EngineConfig, max_seq_len: int, learned_bytes: int,
                free_bytes: int | None = None) -> Sizing:
    """Fit the KV slots to the budget beside what the graphs, buffers, compile workers and learned
    tables take (on CPU all share the host's free memory); raise ValueError where even that does
    not fit."""
    capacity = max_seq_len + cfg.max_step_tokens
    chunk = min(cfg.prefill_chunk, max_seq_len)  # a prompt is shorter: its masks need no more rows
    budget = cfg.kv_cache_memory
    assert not isinstance(budget, str)  # EngineConfig parses memory strings into bytes
    cpu = runner.device.type == "cpu"
    if free_bytes is None and (budget is None or isinstance(budget, float) or cpu):
        free_bytes = free_memory(runner.device)
    process = (process_rss() or 0) if cpu else 0
    no_kv = KVPlan(0, capacity, runner.kv_bytes_per_token, 0, None, 0)

    def plan(proc: int, kv: KVPlan, slots: int) -> MemoryPlan:
        buckets = graph_buckets(cfg, runner.device.type, slots, capacity, chunk)
        return memory_plan(runner, cfg, proc, kv, slots, capacity, chunk, buckets, learned_bytes)

    beside = plan(0, no_kv, cfg.max_batch).beside_kv_bytes  # graphs, buffers, compile workers
    if cpu and free_bytes is not None and free_bytes < beside + learned_bytes:
        plan(process, no_kv, cfg.max_batch).check(free_bytes)
    kv = plan_kv(cfg.max_batch, capacity, runner.kv_bytes_per_token, cfg.max_step_tokens * capacity * runner.dtype.itemsize,
                 budget, None if free_bytes is None else max(free_bytes - (beside if cpu else 0), 0),
                 reserved_tokens=cfg.prefix_cache_tokens, learned_bytes=learned_bytes, learned_in_free=cpu)
    memory = plan(process, kv, kv.slots)
    if cpu:
        memory.check(free_bytes)
    return Sizing(kv, memory, graph_buckets(cfg, runner.device.type, kv.slots, capacity, chunk), capacity, chunk)

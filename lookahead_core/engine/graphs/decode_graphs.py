"""The runner's compiled graphs: which ready graph runs a step, replaying it, timing it alone.

On CPU a graph is an AOTInductor package over the one copy of the weights (package_store.py):
one decode graph takes every batch, width and key count the engine runs, a prefill graph any
prompt chunk of any slot; packages not yet stored are compiled in worker processes
(compile_worker.py) while steps run eagerly, and each loads the step after it is stored. On CUDA
each bucket of `cuda_buckets` is `torch.compile`d with CUDA graphs at its fixed shape before the
engine serves. Graphs hand over to the engine's thread through `poll`, the one place the set of
ready graphs changes.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from lookahead_core.engine.graphs import inductor
from lookahead_core.engine.graphs.buckets import Bucket, cheapest
from lookahead_core.engine.graphs.check import check_graph
from lookahead_core.engine.graphs.compile_worker import GraphJob, compile_in_worker, constants_signature
from lookahead_core.engine.graphs.inductor import compile_cuda_graph
from lookahead_core.engine.graphs.package_store import (
    PackageName,
    PackageStore,
    Run,
    architecture,
    buffers_digest,
    digest,
    folder_bytes,
)
from lookahead_core.engine.graphs.retries import Retries
from lookahead_core.engine.graphs.staging import DynamicStaging, StaticStaging
from lookahead_core.engine.graphs.step import GRAPH_SOURCE, StepModule, constants, decode_step, prefill_step
from lookahead_core.engine.graphs.timing import alone_costs, time_pending
from lookahead_core.engine.runner.step_threads import StepThreads

log = logging.getLogger(__name__)


@dataclass
class Graph:
    """One bucket's graph and what it did."""

    bucket: Bucket
    staging: DynamicStaging | StaticStaging
    run: Run | None = None  # set once ready
    compile_s: float | None = None  # compile (or load) seconds
    cached: bool | None = None  # loaded from the store
    code_bytes: int = 0
    calls: int = 0
    alone_ms: dict[tuple[int, int], float] = field(default_factory=dict)  # (batch, width) -> ms, timed alone
    untimed: list[tuple[int, int]] = field(default_factory=list)
    timing: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # the calls of a cell under way


class DecodeGraphs:
    """The compiled graphs of one runner over its model `step` modules and KV slot tensors `kv`.

    `buckets`: the graphs (dynamic on CPU, static on CUDA). `mode`: "on" makes every graph ready
    in `start` before it returns, "auto" serves at once and makes them ready in the background.
    The logits a replay returns are a view of the graph's output, valid until its next call."""

    def __init__(self, model: torch.nn.Module, kv: list[torch.Tensor], capacity: int, buckets: Iterable[Bucket], *,
                 mode: str = "auto", store: PackageStore | None = None, layout: str = "plain",
                 threads: StepThreads | None = None, workers: int = 1) -> None:
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cuda = self.device.type == "cuda"
        self.model, self.kv, self.capacity, self.scratch = model, kv, capacity, capacity - 1
        config: Any = model.config
        self.vocab_size = int(config.vocab_size)
        self.mode, self.layout, self.threads, self.workers = mode, layout, threads, max(1, workers)
        self.store = store or PackageStore()
        self.steps = {False: StepModule(model, decode_step), True: StepModule(model, prefill_step)}
        self._constants = constants(self.steps[False])  # the one copy each graph reads
        self.graphs: dict[Bucket, Graph] = {}
        for b in buckets:
            staging_type = StaticStaging if not b.dynamic else DynamicStaging
            self.graphs[b] = Graph(b, staging_type(b, kv, self.scratch, self.dtype, self.device))
        self.ready: set[Bucket] = set()  # changed on the engine's thread only (`poll`)
        self.failed: dict[Bucket, str] = {}
        self.retries = Retries()  # when a graph that raised is checked again
        self.calls = 0
        self.graph_failures = 0
        self.changes = 0  # graphs made ready, dropped or timed, ever: what the runner's prices read
        self._arrived: queue.SimpleQueue[tuple[Bucket, Run | None, str | None]] = queue.SimpleQueue()
        self._arange = torch.arange(capacity, device=self.device)
        self._worker: threading.Thread | None = None
        self._compiling: set = set()  # compile workers' processes under way
        self._closed = False

    # ---- making graphs ready ------------------------------------------------------------------

    def name(self, bucket: Bucket) -> PackageName:
        """A CPU graph's package name: its shape, the build, and what its code depends on."""
        st = self.graphs[bucket].staging
        assert isinstance(st, DynamicStaging)
        # the buffers' values too: a graph takes those its code folds as they were when it was traced
        rest = (architecture(self.model.config), str(self.dtype), self.layout, bucket, st.export_dims(),
                tuple(self.kv[0].shape), len(self.kv), sorted(inductor.aoti_options().items()),
                constants_signature(self.steps[bucket.prefill]), buffers_digest(self.model))
        return PackageName(bucket.slug, digest(inductor.build_key(GRAPH_SOURCE), 4), digest(rest, 10))

    def job(self, bucket: Bucket) -> GraphJob:
        return GraphJob(bucket, self.name(bucket), str(self.store.root), type(self.model), self.model.config,
                        self.dtype, self.layout, tuple(self.kv[0].shape), len(self.kv) // 2, self.scratch,
                        constants_signature(self.steps[bucket.prefill]), inductor.aoti_options(),
                        {name: t.detach().clone() for name, t in self.model.named_buffers()},
                        self.threads.compile_cores if self.threads is not None else None)

    def start(self) -> None:
        """Make every graph ready: now ("on", or any mode on CUDA) or in the background ("auto")."""
        if self.cuda:
            for b in self.graphs:
                self._arrived.put(self._compile_cuda(b))
            self.poll()
            return
        if self.mode == "on":
            self._make_ready()
            self.poll()
            return
        self._worker = threading.Thread(target=self._make_ready, name="graphs", daemon=True)
        self._worker.start()

    def _make_ready(self) -> None:
        """Stored packages load first, all of them; the rest compile, `workers` at a time."""
        todo = list(self.graphs)
        missing = [b for b in todo if not self._load(b, cached=True)]
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="compile") as pool:
            list(pool.map(self._compile, missing))

    def _load(self, bucket: Bucket, cached: bool) -> bool:
        t0 = time.perf_counter()
        name = self.name(bucket)
        run = self.store.load(name, self._constants)
        if run is None:
            return False
        g = self.graphs[bucket]
        g.code_bytes = folder_bytes(self.store.folder(name))
        if cached:
            g.compile_s, g.cached = time.perf_counter() - t0, True
        self._arrived.put((bucket, run, None))
        return True

    def _compile(self, bucket: Bucket) -> None:
        g = self.graphs[bucket]
        if self._closed:
            return
        try:
            g.compile_s = compile_in_worker(self.job(bucket), self._started)
            g.cached = False
            if not self._load(bucket, cached=False):
                raise RuntimeError(f"the package of {bucket} was stored but does not load")
            log.warning("compiled %s in %.1f s", bucket, g.compile_s)
        except Exception as exc:  # a graph that cannot compile leaves its steps eager
            if self._closed:
                return
            log.exception("compiling %s failed; its steps run without it", bucket)
            self._arrived.put((bucket, None, f"{type(exc).__name__}: {exc}"))

    def _compile_cuda(self, bucket: Bucket) -> tuple[Bucket, Run | None, str | None]:
        g = self.graphs[bucket]
        try:
            g.compile_s, run = compile_cuda_graph(self.steps[bucket.prefill], g.staging, bucket, self.kv, len(self.graphs))
        except Exception as exc:
            log.exception("compiling %s failed; its steps run without it", bucket)
            return bucket, None, f"{type(exc).__name__}: {exc}"
        g.cached = False
        return bucket, run, None

    def _started(self, process) -> None:
        self._compiling.add(process)
        if self._closed:
            process.kill()

    def close(self) -> None:
        """Make nothing more ready: compile workers under way are killed, so a host that stops
        never waits on a compile (at exit Python joins the threads that wait on them)."""
        self._closed = True
        for process in list(self._compiling):
            if process.is_alive():
                process.kill()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background work; True once nothing is compiling."""
        if self._worker is not None:
            self._worker.join(timeout)
        return self._worker is None or not self._worker.is_alive()

    def poll(self) -> bool:
        """On the engine's thread: take the graphs made ready since the last call (each checked
        against the eager forward first), and dropped graphs whose pause has passed, checked again;
        True where the set of ready graphs changed."""
        changed = False
        for bucket in self.retries.due(time.monotonic()):  # checked again as a graph arriving is
            self._arrived.put((bucket, self.graphs[bucket].run, None))
        while True:
            try:
                bucket, run, error = self._arrived.get_nowait()
            except queue.Empty:
                return changed
            g = self.graphs[bucket]
            if run is not None and error is None:
                error = self._check(g, run)
            if error is not None:
                self.failed[bucket] = error
                if bucket in self.retries.drops:  # a dropped graph that fails its check again waits its next pause
                    self.retries.dropped(bucket, time.monotonic())
                continue
            g.run = run
            g.untimed = bucket.timed_cells()
            self.failed.pop(bucket, None)
            self.ready.add(bucket)
            self.changes += 1
            changed = True

    def _check(self, g: Graph, run: Run) -> str | None:
        return check_graph(g.bucket, g.staging, run, self.steps[g.bucket.prefill], self.kv, self.vocab_size, self.dtype)

    # ---- running --------------------------------------------------------------------------------

    def can_run(self, rows: int, width: int, kv_len: int, cache) -> Bucket | None:
        """The ready decode graph that runs a step of `rows` x `width` attending to `kv_len` keys
        over the cache's rows [0, rows), or None: run it eagerly."""
        lo, hi = cache.rows
        if lo != 0 or hi != rows or kv_len > self.scratch:  # the scratch column stays outside every real write
            return None
        return cheapest(self.ready, rows, width, kv_len)

    def can_prefill(self, width: int, kv_len: int, cache) -> Bucket | None:
        """The ready prefill graph that runs a prompt chunk `width` tokens long of the one slot the
        cache is prepared for, or None. Its graph returns the chunk's last row only."""
        if cache.write_start is None or kv_len > self.scratch:
            return None
        return cheapest(self.ready, 1, width, kv_len, prefill=True)

    def replay(self, bucket: Bucket, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
               cache) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(greedy next token [B, T], logits [B, T, V]) of the step in `bucket`'s graph; the cache is
        prepared for the step. None when the graph raised: the bucket is dropped and the caller runs
        the step eagerly (its writes go to the same KV columns)."""
        rows, width = input_ids.shape
        g = self.graphs[bucket]
        assert g.run is not None
        if cache.write_start is not None:
            g.staging.stage(input_ids, position_ids, None, cache.write_start, mask, self._arange, cache.rows[0])
        else:
            g.staging.stage(input_ids, position_ids, cache.write_index, None, mask, self._arange)
        try:
            logits, pred = g.run(g.staging.inputs())
        except Exception as exc:
            self._drop(bucket, exc)
            return None
        g.calls += 1
        self.calls += 1
        return pred[:rows, :width], logits[:rows, :width]

    def _drop(self, bucket: Bucket, exc: Exception) -> None:
        """A ready graph that raised runs no steps until it passes its check again after a pause
        (`retries`): the bucket turns failed (on /health, the replica "degraded") and its
        steps run in another ready graph or eagerly."""
        self.ready.discard(bucket)
        self.failed[bucket] = f"{type(exc).__name__}: {exc}"
        self.graph_failures += 1
        self.changes += 1
        pause = self.retries.dropped(bucket, time.monotonic())
        if pause is not None:
            log.error("%s raised; its steps run without it, checked again in %.0f s", bucket, pause, exc_info=exc)
        else:
            log.error("%s raised again; its steps run without it from now on", bucket, exc_info=exc)

    # ---- timing alone (graphs/timing.py) ------------------------------------------------------

    def time_pending(self, pending: Callable[[], bool] = lambda: False) -> bool:
        return time_pending(self, pending)

    @property
    def timed(self) -> bool:
        """Every ready graph timed alone at each of its cells."""
        return all(not self.graphs[b].untimed for b in self.ready)

    def alone_costs(self) -> dict[int, dict[int, float]]:
        return alone_costs(self)

    def code_bytes(self) -> int:
        return sum(g.code_bytes for g in self.graphs.values() if g.bucket in self.ready)

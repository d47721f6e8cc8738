"""The decode forward's compiled graphs, one per bucket, owned and called by `ModelRunner`.

The eager decode forward re-dispatches every op of the model each step; `torch.compile`
(inductor) fuses the elementwise work and, on CPU with freezing, folds the weights into constants
and packs them once. A step [B, T] attending to kv_len keys runs in the cheapest ready bucket
(Bb >= B, Tb >= T, Kb >= kv_len), its inputs padded in the bucket's staging buffers
(bucket_staging.py); the runner runs steps outside every bucket eagerly. With `dynamic` (the CPU
default) a bucket's graph takes any key length up to its own unpadded (attention reads only the
keys the step has), and a bucket wider than two any width from 2 to its own: a one-token bucket
and one wide bucket per batch then hold every step the planner may pick (a narrow bucket beside
them runs steps of 2 to 4 tokens with GEMM kernels picked for that width, `Bucket.narrow`; graphs
of 3 or 4 rows take inductor's GEMM template, `Bucket.template_gemms`).

On CPU, freezing turns every *static* graph input into a constant, so nothing is marked static
there and each frozen graph holds its own packed copy of the weights. There a bucket's graph is
compiled ahead of time into a package kept on disk (exported_step.py): a later start on the
machine loads it instead of tracing and freezing the model again. On CUDA, `torch.compile` with
`mode="reduce-overhead"` records CUDA graphs over staging buffers and KV tensors marked static.
"""
from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._inductor import list_mode_options

from lookahead_core.engine.bucket_staging import TIMED_WIDTHS, Bucket, BucketCache, DynamicStaging, Staging, slot_tensors
from lookahead_core.engine.compile_setup import (
    CompileThrottle,
    compiling,
    inductor_options,
    install_sdpa_gqa,
    quiet_autotune,
    recompile_limit,
    release_freed_memory,
    start_low_priority,
    weights_tag,
)
from lookahead_core.engine.exported_step import ExportedStep, package_name
from lookahead_core.engine.package_store import PackageStore
from lookahead_core.engine.step_threads import StepThreads

log = logging.getLogger(__name__)
_compile_lock = threading.Lock()


def _pow2_upto(limit: int) -> tuple[int, ...]:
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return tuple(out)


def _decode_step(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                 cols: torch.Tensor, cache: BucketCache):
    cache.bind(cols, mask.shape[-1])
    logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True).logits
    return logits, logits.argmax(dim=-1)


def _prefill_step(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                  cols: torch.Tensor, cache: BucketCache):
    """A prompt chunk: the last row's logits only (the LM head is a fifth of a row's FLOPs, and
    no other row's logits are read when a prompt is prefilled without its logprobs)."""
    cache.bind(cols, mask.shape[-1])
    logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True,
                   logits_to_keep=1).logits
    return logits, logits.argmax(dim=-1)


class CompiledForward:
    """The decode step's compiled graphs, for the `ModelRunner` that owns them: `can_run` names the
    bucket whose graph holds a step (the cheapest ready one), `replay` runs it there; the runner
    runs every other step eagerly.

    batch_buckets / width_buckets: sizes B and T are padded to (default: powers of two up to the
    cache's max_batch / `max_width`); kv_buckets: key lengths (the most a bucket holds; a static
    one pads to it), the cache's capacity always the last. dynamic (default on CPU): graphs take
    any key length, and any width from 2 where the bucket is wider than two. freezing (default on
    CPU) and gemm_autotune: `inductor_options`; mode: default "reduce-overhead" on CUDA. A bucket
    compiles in `warmup`, on `compile_in_background`'s thread, or (`lazy`) on the first step that
    needs it; else that step runs eagerly.

    The cache's decode rows are slots [0, B). The logits returned are a view of the graph's
    output, valid until the next call. Each bucket has a compiled function of its own, holding
    its graph only: on CPU with freezing its package (`ExportedStep`), else `torch.compile`'s,
    with dynamo's guards on the model skipped (they re-read every module attribute on each call;
    the model never changes after load).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache,
        *,
        max_width: int = 16,
        batch_buckets: Iterable[int] | None = None,
        width_buckets: Iterable[int] | None = None,
        kv_buckets: Iterable[int] | None = None,
        compile: bool = True,
        lazy: bool = True,
        freezing: bool | None = None,
        gemm_autotune: bool = True,
        mode: str | None = None,
        load_share: float = 0.25,
        dynamic: bool | None = None,
        threads: StepThreads | None = None,
    ) -> None:
        self.model, self.cache = model, cache
        self.threads = threads  # a graph is compiled for, and timed on, the threads its batch runs on
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.capacity = cache.capacity
        self.scratch = cache.capacity - 1
        cuda = self.device.type == "cuda"
        self.batch_buckets = tuple(sorted(set(batch_buckets or _pow2_upto(cache.max_batch))))
        self.width_buckets = tuple(sorted(set(width_buckets or _pow2_upto(max_width))))
        if self.batch_buckets[-1] > cache.max_batch:
            raise ValueError(f"batch bucket {self.batch_buckets[-1]} exceeds the cache's {cache.max_batch} slots")
        kv = sorted({k for k in (kv_buckets or ()) if k < self.capacity} | {self.capacity})
        self.kv_buckets = tuple(kv)
        self.freezing = (not cuda) if freezing is None else freezing
        self.static_inputs = cuda and not self.freezing  # freezing would fold static inputs into constants
        # CUDA graphs replay fixed shapes
        self.dynamic = (not cuda) if dynamic is None else dynamic
        self.inductor_options = inductor_options(cuda, gemm_autotune) if self.freezing else {}
        self.template_options = inductor_options(cuda, gemm_autotune, template_only=True) if self.freezing else {}
        self.mode = mode if mode is not None else ("reduce-overhead" if cuda else None)
        self.cudagraphs = cuda and self.mode in ("reduce-overhead", "max-autotune")
        options: dict[str, Any] = {**(list_mode_options(self.mode) if self.mode else {}),
                                   "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        # One compiled function per bucket, each with its own graphs (isolate_recompiles): dynamo
        # runs the newest graph whose guards admit the inputs, so with one function for all, a
        # wide graph of dynamic width took the steps a narrow one was compiled for.
        graphs = len(self.batch_buckets) * len(self.width_buckets) * len(self.kv_buckets) + 1  # and a prefill graph
        limit = recompile_limit(graphs)  # per function where torch isolates them, else for all
        self._jit: Callable[[Callable], Callable] = (
            lambda step: torch.compile(step, fullgraph=True, dynamic=False, options=options, **limit))
        self.compile = compile
        self.packaged = compile and self.freezing  # graphs compiled ahead of time, kept as packages
        install_sdpa_gqa()
        quiet_autotune()
        self.cache_tag = weights_tag(model) if self.packaged else ""
        self.store = PackageStore()  # where packaged graphs are kept (nothing is read until one is asked for)
        self._compiler: threading.Thread | None = None
        self.lazy = lazy  # compile a bucket on its first step; else only warmed-up buckets run compiled
        self.ready: set[Bucket] = set()
        self.ready_changes = 0  # buckets added to or dropped from `ready`, or timed alone, ever
        self.failed: dict[Bucket, str] = {}
        # Ready graphs the background compile left untimed: the engine's thread times them while
        # idle (`time_pending`). Timed on the compile thread, a two-thread graph ran beside the
        # engine thread's OpenMP team, four threads on two cores, and read 2-3x its cost.
        self.untimed: list[Bucket] = []
        self.busy = False  # set by the engine while it has requests: a background compile slows down
        self.load_share = load_share
        self.beat = 0  # the engine's step count
        self._arange = torch.arange(self.capacity, device=self.device)
        self._staging: dict[Bucket, Staging | DynamicStaging] = {}
        self.calls = 0  # steps run in a graph
        self.graph_failures = 0  # calls of ready graphs that raised (each reran eagerly)

    # ---- buckets ----------------------------------------------------------------------------

    def bucket_for(self, rows: int, width: int, kv_len: int) -> Bucket | None:
        """With `lazy`: the smallest bucket of the size grid holding the step (compiled on its first
        step), or None (the eager forward runs it)."""
        if kv_len > self.scratch:  # the scratch column must stay outside every real write
            return None
        picks: list[int] = []
        for size, sizes in ((rows, self.batch_buckets), (width, self.width_buckets), (kv_len, self.kv_buckets)):
            i = bisect.bisect_left(sizes, size)
            if i == len(sizes):
                return None
            picks.append(sizes[i])
        return Bucket(picks[0], picks[1], picks[2])

    def ready_bucket_for(self, rows: int, width: int, kv_len: int) -> Bucket | None:
        """The cheapest compiled bucket that holds the step (fewest padded rows x width x keys), or
        None. Batch, width and keys are not rounded up apart: with buckets (1, 1), (8, 1) and
        (32, 16), a step (4, 3) runs in (32, 16), never in an uncompiled (8, 4)."""
        if kv_len > self.scratch:  # the scratch column must stay outside every real write
            return None
        held = [b for b in list(self.ready)  # one copy: the compile thread adds to it
                if b.batch >= rows and b.width >= width and b.kv >= kv_len and not b.prefill]
        # a dynamic graph reads the step's own keys, whichever bucket holds it; on a tie the graph
        # compiled (and tuned) at the step's own width wins, then the narrowest (tuned nearest it)
        return min(held, key=lambda b: (b.batch * self.run_width(b, width) * (kv_len if self.dynamic else b.kv),
                                        b.batch, self.is_dynamic(b), b.width), default=None)

    def is_dynamic(self, bucket: Bucket) -> bool:
        """Its graph takes any width in [2, bucket.width]."""
        return self.dynamic and bucket.dynamic_width

    def graph_widths(self, bucket: Bucket) -> list[int]:
        """The widths a bucket's graph runs steps at (those it is timed at alone)."""
        return self._stage_for(bucket).timed_widths()

    def run_width(self, bucket: Bucket, width: int) -> int:
        """The width a step `width` wide runs at in `bucket`."""
        return bucket.step_width(width) if self.dynamic else bucket.width

    def _stage_for(self, bucket: Bucket) -> Staging | DynamicStaging:
        st: Staging | DynamicStaging | None = self._staging.get(bucket)
        if st is None:
            pairs = slot_tensors(self.cache, self.model, self.dtype, self.device)
            if self.static_inputs:
                for k, v in pairs:
                    torch._dynamo.mark_static_address(k)
                    torch._dynamo.mark_static_address(v)
            if self.dynamic:
                st = DynamicStaging(bucket, pairs, self.scratch, self.dtype, self.device)
            elif bucket.prefill:
                raise ValueError(f"{bucket}: a prefill graph needs dynamic shapes (CPU)")
            else:
                st = Staging(bucket, pairs, self.scratch, self.dtype, self.device, self.static_inputs)
            st.graph = self._graph_for(_prefill_step if bucket.prefill else _decode_step, st)
            self._staging[bucket] = st
        return st

    def _graph_for(self, step: Callable, st: Staging | DynamicStaging) -> Callable:
        """The bucket's own function: its package (CPU, freezing), else `torch.compile`'s."""
        if not self.compile:
            return step
        if not self.packaged:
            return self._jit(step)
        options, dims = self.options_for(st.bucket), st.export_dims()
        kv = st.cache.slot_tensors()
        name = package_name(weights=self.cache_tag, model=self.model, bucket=st.bucket, step=step, options=options,
                            dims=dims, kv_shape=(*kv[0].shape, str(kv[0].dtype)), layers=len(kv) // 2,
                            threads=self._threads_for(st.bucket))
        return ExportedStep(step, st.bucket, options, dims, name, self.store)

    # ---- running ----------------------------------------------------------------------------

    def _threads_for(self, bucket: Bucket) -> int:
        return self.threads.for_batch(bucket.batch, bucket.prefill) if self.threads is not None else torch.get_num_threads()

    def options_for(self, bucket: Bucket) -> dict:
        """The inductor settings a bucket's graph is compiled with."""
        return self.template_options if bucket.template_gemms else self.inductor_options

    def _run(self, st: Staging | DynamicStaging) -> tuple[torch.Tensor, torch.Tensor]:
        first = st.compile_s is None
        t0 = time.perf_counter() if first else 0.0
        # Inductor reads its flags when it compiles, i.e. on a bucket's first call; freezing as a
        # `torch.compile` option is not applied. The flags are global: only the thread that
        # compiles (one at a time, `_compile_lock`) sets them, and eager forwards never read them.
        setup = (compiling(self.options_for(st.bucket), self.cache_tag) if first and not self.packaged
                 else contextlib.nullcontext())
        if first and self.threads is not None:  # inductor's C++ kernels take the compiling thread's count
            self.threads.use(st.bucket.batch, st.bucket.prefill)
        with _compile_lock if first else contextlib.nullcontext(), setup as loaded, torch.inference_mode():
            if self.cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            logits, pred = st.graph(self.model, *st.inputs())
        if first:
            st.compile_s = time.perf_counter() - t0
            st.cached = st.graph.cached if isinstance(st.graph, ExportedStep) else bool(loaded and loaded[0])
            self.ready.add(st.bucket)
            self.ready_changes += 1
        st.calls += 1
        return logits, pred

    def warmup(self, buckets: Iterable[Bucket | tuple[int, int, int]], timed: bool = True) -> dict[Bucket, float]:
        """Compile these buckets now with an all-padding step (it writes only scratch columns), one
        log line each, and (`timed`) time each alone. Returns the seconds each first call took
        (compile or load included)."""
        out = {}
        for b in buckets:
            bucket = b if isinstance(b, Bucket) else Bucket(*b)
            st = self._stage_for(bucket)
            st.clear()
            first = st.compile_s is None
            self._run(st)
            if first and st.compile_s is not None:
                out[bucket] = st.compile_s
                log.warning("%s %s in %.1f s", "loaded" if st.cached else "compiled", bucket,
                            st.compile_s)
                release_freed_memory()
            if timed and st.timed_alone is None:
                self.time_alone(bucket)
        return out

    def time_alone(self, bucket: Bucket) -> None:
        """Time a ready bucket's graph alone (`_time_alone`), for the planner's prices and /health."""
        st = self._stage_for(bucket)
        if self.threads is not None:
            self.threads.use(bucket.batch, bucket.prefill)
        st.alone_ms = self._time_alone(st)
        st.timed_alone = bool(st.alone_ms)
        self.ready_changes += 1  # the runner's prices read the new timings

    def time_pending(self) -> bool:
        """Time one graph the background compile made ready (`time_alone`) on the calling thread,
        the engine's, while it has no request; True if one was timed."""
        if self.busy or not self.untimed:
            return False
        bucket = self.untimed[0]
        self.time_alone(bucket)
        self.untimed.remove(bucket)  # after the timing: the compile thread waits for it (`_await_timing`)
        return True

    def _await_timing(self, patience_s: float = 5.0) -> None:
        """On the compile thread, before a compile: wait while the engine's thread times the ready
        graphs, so that no timing runs beside a compile. Stops waiting once the engine has requests
        (nothing is timed then) or takes none for `patience_s` (no engine loop calls `time_pending`)."""
        left, deadline = len(self.untimed), time.monotonic() + patience_s
        while self.untimed and not self.busy:
            if len(self.untimed) != left:
                left, deadline = len(self.untimed), time.monotonic() + patience_s
            elif time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def _time_alone(self, st: Staging | DynamicStaging, calls: int = 3) -> dict[int, float]:
        """Per width the graph runs at (`timed_widths`), the fastest of a few all-padding calls
        after one untimed call, while the engine has no request: what its steps cost with the cores
        to itself (a preempted call only errs slow), the planner's prices before the engine has run
        them (`alone_costs`), and beside which /health shows what the same steps cost served.
        Empty when the engine stepped meanwhile (not alone)."""
        out: dict[int, float] = {}
        with torch.inference_mode():
            for width in st.timed_widths():
                if self.busy:
                    return {}
                st.pad_view(width)
                inputs, times = st.inputs(), []
                for _ in range(calls + 1):
                    if self.cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    t0 = time.perf_counter()
                    st.graph(self.model, *inputs)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    times.append((time.perf_counter() - t0) * 1000.0)
                out[width] = round(min(times[1:]), 3)
        st.clear()
        return {} if self.busy else out

    def alone_costs(self, kv_len: int = 256) -> dict[int, dict[int, float]]:
        """{batch: {width: ms}} for the widest batch of each power-of-two range up to the cache's
        slots: what a step of each TIMED_WIDTHS width costs alone in the ready graph that would run
        it (`ready_bucket_for` at `kv_len` keys, or the most a step may attend to), where that
        graph was timed."""
        table: dict[int, dict[int, float]] = {}
        kv_len = min(kv_len, self.scratch)
        for batch in _pow2_upto(self.cache.max_batch):
            cells = {}
            for width in TIMED_WIDTHS:
                bucket = self.ready_bucket_for(batch, width, kv_len)
                st = self._staging.get(bucket) if bucket is not None else None
                if st is not None and (ms := st.alone_ms.get(self.run_width(st.bucket, width))) is not None:
                    cells[width] = ms
            if cells:
                table[batch] = cells
        return table

    def compile_in_background(self, buckets: Iterable[Bucket | tuple[int, int, int]]) -> threading.Thread:
        """Compile these buckets one by one on a daemon thread while steps run eagerly (those whose
        package is stored load first); each bucket runs compiled from the step after it is ready,
        and waits in `untimed` for the engine's thread to time it. Each bucket's first call (the compile) writes
        only scratch columns, so it may overlap the engine's steps. A bucket started while `busy`
        is set (the engine sets it while it has requests) takes `load_share` of the time while the
        engine has requests (0: it waits); one started while the engine is idle runs unpaced to its
        end (`CompileThrottle.attach`)."""
        todo = [b if isinstance(b, Bucket) else Bucket(*b) for b in buckets]
        for b in todo:  # staging and the KV tensors are created here, not raced by the thread
            self._stage_for(b)

        throttle = CompileThrottle(self, self.load_share)

        def work() -> None:
            # Graphs stored on disk load first, all of them: each serves within seconds of the start.
            stored = [b for b in todo if self._stored(b)]
            for b in stored + [b for b in todo if b not in stored]:
                if b not in stored:
                    self._await_timing()
                throttle.attach()
                try:
                    self.warmup([b], timed=False)
                except Exception as exc:  # a bucket that cannot compile keeps running eagerly
                    self.failed[b] = f"{type(exc).__name__}: {exc}"
                    log.exception("compiling %s failed; its steps run without it", b)
                if b in self.ready:
                    self.untimed.append(b)

        cores = self.threads.compile_cores if self.threads is not None else None
        self._compiler = start_low_priority("compile-decode-buckets", work, cores)
        return self._compiler

    def _stored(self, bucket: Bucket) -> bool:
        graph = self._stage_for(bucket).graph
        return isinstance(graph, ExportedStep) and graph.stored()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a background compile; True once nothing is compiling."""
        if self._compiler is not None:
            self._compiler.join(timeout)
        return self._compiler is None or not self._compiler.is_alive()

    def status(self) -> list[dict]:
        """Every bucket set up: its shape, whether it runs compiled, its compile (or cache load)
        seconds, whether it came from the on-disk cache, its calls, and what its steps cost alone
        (`timed_alone`: None until timed, False where the engine was stepping then)."""
        return [{"batch": b.batch, "width": b.width, "kv": b.kv, **({"prefill": True} if b.prefill else {}),
                 "ready": b in self.ready,
                 "compile_s": None if st.compile_s is None else round(st.compile_s, 1), "cached": st.cached,
                 "calls": st.calls,
                 "alone_ms": st.alone_ms, "timed_alone": st.timed_alone,
                 **({"error": self.failed[b]} if b in self.failed else {})}
                for b, st in list(self._staging.items())]

    def can_run(self, rows: int, width: int, kv_len: int, cache) -> Bucket | None:
        """The bucket whose graph runs a step of `rows` x `width` attending to `kv_len` keys over
        the cache's rows [0, rows) (`lazy`: compiled on its first step), or None: run it eagerly."""
        lo, hi = cache.rows
        if not (lo == 0 and hi == rows and cache is self.cache) or (self.dynamic and kv_len < 2):
            return None  # (dynamic sizes start at 2)
        bucket = self.bucket_for(rows, width, kv_len) if self.lazy else self.ready_bucket_for(rows, width, kv_len)
        if bucket is not None and bucket.batch > rows and max(cache.lengths[rows : bucket.batch]) > self.scratch:
            return None  # a padding row's slot holds a token in the scratch column
        return bucket

    def can_prefill(self, width: int, kv_len: int, cache) -> Bucket | None:
        """The ready prefill bucket whose graph runs a prompt chunk `width` tokens long of the one
        slot the cache is prepared for, attending to `kv_len` keys, or None. Its graph returns the
        chunk's last row only."""
        if cache is not self.cache or cache.write_start is None or not 2 <= width <= kv_len <= self.scratch:
            return None
        held = [b for b in list(self.ready) if b.prefill and b.width >= width and b.kv >= kv_len]
        return min(held, key=lambda b: b.width, default=None)

    def replay(self, bucket: Bucket, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
               cache) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(greedy next token [B, T], logits [B, T, V]) of the step in `bucket`'s graph; the cache is
        prepared for rows [0, B), mask [B, 1, T, kv_len]. None when the graph raised: the bucket is
        dropped and the caller runs the step eagerly (its writes go to the same KV columns)."""
        rows, width = input_ids.shape
        st = self._stage_for(bucket)
        if cache.write_start is not None:
            st.stage(input_ids, position_ids, None, cache.write_start, mask, self._arange, cache.rows[0])
        else:
            st.stage(input_ids, position_ids, cache.write_index, None, mask, self._arange)
        try:
            logits, pred = self._run(st)
        except Exception as exc:
            self._drop(bucket, exc)
            return None
        self.calls += 1
        return pred[:rows, :width], logits[:rows, :width]

    def _drop(self, bucket: Bucket, exc: Exception) -> None:
        """A ready graph that raised runs no more steps: the bucket turns failed (on /health) and
        its steps run in another ready bucket or eagerly."""
        self.ready.discard(bucket)
        self.ready_changes += 1
        self.failed[bucket] = f"{type(exc).__name__}: {exc}"
        self.graph_failures += 1
        log.exception("%s raised; its steps run without it from now on", bucket)

"""A compiled decode forward: `ModelRunner.forward` at static shapes, from a few buckets.

The eager decode forward re-dispatches every op of the model each step;
`torch.compile` (inductor) fuses the elementwise work and, on CPU with freezing, folds the weights
into constants and packs them once for MKL's packed GEMM. Compiled graphs want static shapes, so a
step [B, T] attending to kv_len keys runs in the cheapest ready bucket (Bb >= B, Tb >= T, Kb >= kv_len):

* inputs are staged into buffers of the bucket's shape, allocated once per bucket;
* padding positions (rows >= B, columns >= T) take token 0 at position 0, see key column 0 only
  (a row that sees nothing turns to NaN) and write their keys to the *scratch column*
  `capacity - 1` of their slot, which no committed token occupies (the engine's capacity is
  max_seq_len + max_step_tokens; `forward` checks it) and no real write reaches (kv_len <
  capacity);
* keys and values are written in place into the `BatchKVCache` slot tensors (one index_put per
  layer), and attention reads `keys[:Bb, :, :Kb]`, the mask hiding everything past each row's
  own block;
* logits and the greedy argmax come out of the graph; `ModelRunner.forward` takes the real rows'
  argmax (and top-k) to the host in one transfer, the step's one sync.

Shapes outside every bucket, or a cache state the buckets cannot express, run the eager forward.

On CPU the graphs are compiled with inductor freezing (set around a bucket's first call): every
*static* graph input turns into a constant, so nothing here is marked with `mark_static_address`
on CPU; the staging buffers and KV tensors stay ordinary graph inputs. Each frozen graph holds its own packed copy of the weights. On CUDA,
`mode="reduce-overhead"` records CUDA graphs; there the staging buffers and KV tensors are marked
static (no copies into the graph's inputs) and freezing is off.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._inductor import list_mode_options, select_algorithm
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations import sdpa_attention

log = logging.getLogger(__name__)
_compile_lock = threading.Lock()


def _pow2_upto(limit: int) -> tuple[int, ...]:
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return tuple(out)


class _BucketLayer(CacheLayerMixin):
    """One layer's view of the shared slot tensors at a bucket's shape."""

    is_sliding = False
    is_compileable = True
    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, owner: _BucketCache, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.owner = owner
        self.keys, self.values = keys, values  # [max_batch, heads, capacity, head_dim], shared with the engine
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the slot tensors exist already
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        o = self.owner
        # [Bb, H, Tb, D] -> [Bb, Tb, H, D]: row r, step token t lands at (rows[r], :, cols[r, t]).
        self.keys[o.rows, :, o.cols] = key_states.transpose(1, 2)
        self.values[o.rows, :, o.cols] = value_states.transpose(1, 2)
        return self.keys[: o.batch, :, : o.kv], self.values[: o.batch, :, : o.kv]

    def get_seq_length(self) -> int:
        return self.owner.kv

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv, 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class _BucketCache(Cache):
    """A transformers Cache over the engine's slot tensors with a bucket's static shape."""

    def __init__(self, kv_pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor, cols: torch.Tensor,
                 kv: int) -> None:
        self.rows, self.cols = rows, cols  # [Bb, 1] slot of each row, [Bb, Tb] KV column of each token
        self.batch, self.kv = rows.shape[0], kv
        super().__init__(layers=[_BucketLayer(self, k, v) for k, v in kv_pairs])


def install_sdpa_gqa() -> None:
    """Grouped-query attention inside SDPA (`enable_gqa`) in compiled graphs, rather than `repeat_kv`,
    which copies the attended keys and values once per query head group in every layer.
    transformers decides per call in `use_gqa_in_sdpa` (on CPU: only without a mask); the CPU
    kernels take a mask with `enable_gqa`. The decision is replaced once, process-wide, by one that
    says yes while dynamo traces and defers to transformers otherwise.

    "While dynamo traces" is `is_dynamo_compiling` (folded to True in a trace, False in eager), not
    `is_compiling`, which in torch 2.13 is one process-wide flag held for a whole compile: with
    it, eager steps on the engine thread took the compiled arithmetic while a bucket compiled in
    the background. transformers' attention reads that flag too (its one-query `pack_gqa`), so
    its module gets the per-trace test as well: eager forwards keep transformers' own arithmetic
    on any thread, during a background compile too."""
    if getattr(sdpa_attention.use_gqa_in_sdpa, "_lookahead_gqa", False):
        return
    original = sdpa_attention.use_gqa_in_sdpa

    def use_gqa(attention_mask, key, value):  # CUDA's fused kernels refuse enable_gqa with a mask
        return (torch.compiler.is_dynamo_compiling() and key.device.type == "cpu") or original(attention_mask, key, value)

    use_gqa._lookahead_gqa = True  # type: ignore[attr-defined]
    sdpa_attention.use_gqa_in_sdpa = use_gqa
    sdpa_attention.is_torchdynamo_compiling = torch.compiler.is_dynamo_compiling  # type: ignore[attr-defined]


def quiet_autotune() -> None:
    """Inductor prints every GEMM's autotuning table to stderr (about a hundred lines a bucket);
    the compile logs one line per bucket instead. Process-wide, as inductor's switch is."""
    select_algorithm.PRINT_AUTOTUNE = False


def _decode_step(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: Cache):
    logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True).logits
    return logits, logits.argmax(dim=-1)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's `malloc_trim`): a compile frees much of
    what it allocated and glibc keeps freed pages resident (SmolLM2 in float32, bucket (1, 1):
    1,796 MB resident after its compile without this, 1,612 MB with it)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def inductor_options(cuda: bool, gemm_autotune: bool = True) -> dict:
    """Inductor settings for a decode graph, set around its compile. On CPU: freezing (weights
    folded into constants and packed once) and, with `gemm_autotune`, every linear layer timed at
    its own shape between inductor's C++ micro-GEMM template and the packed MKL kernel
    (`max_autotune`, backends CPP and ATEN): on a 2-core AVX2 EPYC, MKL took 1.5x its one-row time
    for two rows and the template 1.06x. On CUDA: nothing (CUDA graphs come from the mode)."""
    if cuda:
        return {}
    options: dict = {"freezing": True}
    if gemm_autotune:
        # the choices' stats go to stderr per GEMM otherwise (quiet_autotune silences the tables)
        options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN", max_autotune_report_choices_stats=False)
    return options


@dataclass(frozen=True)
class Bucket:
    batch: int
    width: int
    kv: int


class _Staging:
    """The static inputs of one bucket, allocated once, and what the last step left in them."""

    def __init__(self, bucket: Bucket, kv_pairs, scratch: int, dtype: torch.dtype, device: torch.device,
                 static: bool) -> None:
        b, t, k = bucket.batch, bucket.width, bucket.kv
        self.ids = torch.zeros((b, t), dtype=torch.long, device=device)
        self.pos = torch.zeros((b, t), dtype=torch.long, device=device)
        self.scratch = scratch
        self.cols = torch.full((b, t), scratch, dtype=torch.long, device=device)
        self.rows = torch.arange(b, device=device)[:, None]
        self.min = torch.finfo(dtype).min
        self.mask = torch.full((b, 1, t, k), self.min, dtype=dtype, device=device)
        self.mask[..., 0] = 0.0  # padding queries see column 0
        self.used = (0, 0, 0)  # (rows, width, kv_len) of real data in the buffers
        if static:  # CUDA graphs: fixed addresses, no copy into the graph's inputs (never with freezing)
            for t_ in (self.ids, self.pos, self.cols, self.rows, self.mask):
                torch._dynamo.mark_static_address(t_)
        self.cache = _BucketCache(kv_pairs, self.rows, self.cols, k)
        self.bucket = bucket
        self.compile_s: float | None = None
        self.alone_ms: float | None = None  # one call's time right after its compile, the engine idle
        self.calls = 0

    def _pad(self, rows: int, width: int, kv_len: int, inputs: bool = True, mask: bool = True) -> None:
        """Put padding back into the region [:rows, :width] (mask: [..., :kv_len])."""
        if not (rows and width):
            return
        if inputs:
            self.ids[:rows, :width].zero_()
            self.pos[:rows, :width].zero_()
            self.cols[:rows, :width].fill_(self.scratch)
        if mask and kv_len:
            m = self.mask[:rows, :, :width, :kv_len]
            m.fill_(self.min)
            m[..., 0] = 0.0

    def stage(self, ids: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor | None, start: int | None,
              mask: torch.Tensor, arange: torch.Tensor) -> None:
        rows, width = ids.shape
        kv_len = mask.shape[-1]
        r0, w0, k0 = self.used
        # Padding back where the last step's real data is not overwritten by this one's; in steady
        # decoding (same rows and width, kv_len growing) nothing needs it.
        self._pad(r0, w0, k0, inputs=(r0, w0) != (rows, width), mask=r0 > rows or w0 > width or k0 > kv_len)
        self.ids[:rows, :width].copy_(ids)
        self.pos[:rows, :width].copy_(pos)
        if cols is not None:
            self.cols[:rows, :width].copy_(cols)
        else:  # one slot written contiguously from `start`
            assert start is not None
            torch.add(arange[:width], start, out=self.cols[0, :width])
        self.mask[:rows, :, :width, :kv_len].copy_(mask)
        self.used = (rows, width, kv_len)

    def clear(self) -> None:
        """Back to all padding (a warm-up step then writes only scratch columns)."""
        self._pad(*self.used)
        self.used = (0, 0, 0)


class CompileThrottle:
    """`sys.settrace` hook for a background compile thread: while `owner.busy` (the engine has
    requests) the thread runs `share` of the time, in turns of `slice_s`, and sleeps at a Python
    call in between; 0 makes it wait until the engine is idle.

    Compiling is Python and holds the GIL; each op of an eager step beside it waits up to the
    switch interval for it (a forward beside a busy Python thread: 24x slower at the default 5 ms,
    still 2.4-3.8x at 1-100 us on 2 cores), so it must yield; but a replica that is never idle
    still gets its compiled steps. An engine that stops stepping (`owner.beat` unchanged for 1 s)
    may wait on a lock this thread holds (logging, an import): then the compile runs on until the
    engine steps again.
    """

    def __init__(self, owner, share: float, slice_s: float = 0.05) -> None:
        self.owner, self.slice_s = owner, slice_s
        self.rest_s = slice_s * (1 - share) / share if share > 0 else float("inf")
        self.turn_start = 0.0
        self.stuck = -1

    def __call__(self, frame, event, arg) -> None:
        owner = self.owner
        if not owner.busy or owner.beat == self.stuck:
            return
        now = time.monotonic()
        if now - self.turn_start < self.slice_s:
            return
        last, since, until = owner.beat, now, now + self.rest_s
        while owner.busy and time.monotonic() < until:
            time.sleep(0.002)
            if owner.beat != last:
                last, since = owner.beat, time.monotonic()
            elif time.monotonic() - since > 1.0:
                self.stuck = last
                break
        self.turn_start = time.monotonic()


def _recompile_limit(graphs: int) -> dict:
    """torch.compile's keywords that let one function hold `graphs` graphs: its own limit where
    torch takes one (2.13), else the process-wide limit raised to it."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return {"isolate_recompiles": True, "recompile_limit": graphs}
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, graphs)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * graphs)
    return {}


class CompiledForward:
    """`forward(input_ids, position_ids, mask, cache)` with `ModelRunner.forward`'s contract
    (greedy next token of every input position as host lists, and the logits [B, T, V]), run
    as a compiled graph in the cheapest ready bucket that holds the step.

    batch_buckets / width_buckets: sizes to pad B and T up to (default: powers of two up to the
    cache's max_batch / `max_width`). kv_buckets: key lengths to pad kv_len up to; the cache's
    capacity is always the last one (None: only the capacity, i.e. attention over every slot
    column). freezing (default on CPU): inductor freezing; gemm_autotune (CPU): see
    `inductor_options`. mode: default "reduce-overhead" on CUDA. On CPU, attention runs
    grouped-query inside SDPA (`install_sdpa_gqa`).

    A bucket compiles one graph in `warmup`, on `compile_in_background`'s thread, or (`lazy`)
    the first time a step needs it; on 2 CPU cores that is about a minute for a 135M model, and
    with freezing every graph keeps its own packed copy of the weights, so keep the set small.
    Without `lazy`, a step whose bucket is not compiled yet runs eagerly.

    The cache must be a `BatchKVCache` whose decode rows are slots [0, B). The logits returned
    are a view of the graph's output, valid until the next call (CUDA graphs reuse it).

    Each instance compiles graphs of its own (`isolate_recompiles`), and dynamo's guards on the
    model are skipped: they re-read every module attribute on each call (0.7-0.9 ms of a 24 ms
    one-token step of SmolLM2 in float32 on 2 AVX2 cores), and the model is never changed after
    load (with freezing its weights are constants of the graph anyway). The inputs' tensor guards
    stay: they pick the bucket's graph.
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
    ) -> None:
        self.model, self.cache = model, cache
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
        self.inductor_options = inductor_options(cuda, gemm_autotune) if self.freezing else {}
        self.mode = mode if mode is not None else ("reduce-overhead" if cuda else None)
        self.cudagraphs = cuda and self.mode in ("reduce-overhead", "max-autotune")
        options: dict[str, Any] = {**(list_mode_options(self.mode) if self.mode else {}),
                                   "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        graphs = len(self.batch_buckets) * len(self.width_buckets) * len(self.kv_buckets)
        self._fn = (torch.compile(_decode_step, fullgraph=True, dynamic=False, options=options,
                                  **_recompile_limit(graphs)) if compile else _decode_step)
        install_sdpa_gqa()
        quiet_autotune()
        self._compiler: threading.Thread | None = None
        self.lazy = lazy  # compile a bucket on its first step; else only warmed-up buckets run compiled
        self.ready: set[Bucket] = set()
        self.ready_changes = 0  # buckets added to or dropped from `ready`, ever
        self.failed: dict[Bucket, str] = {}
        self.busy = False  # set by the engine while it has requests: a background compile slows down
        self.load_share = load_share
        self.beat = 0  # the engine's step count
        self._arange = torch.arange(max(self.width_buckets), device=self.device)
        self._staging: dict[Bucket, _Staging] = {}
        self.calls = 0
        self.eager_calls = 0
        self.graph_failures = 0  # calls of ready graphs that raised (each reran eagerly)

    # ---- buckets ----------------------------------------------------------------------------

    def bucket_for(self, rows: int, width: int, kv_len: int) -> Bucket | None:
        """With `lazy`: the smallest bucket of the size grid holding the step (compiled on its first
        step), or None (the eager forward runs it)."""
        if kv_len > self.scratch:  # the scratch column must stay outside every real write
            return None
        picks = []
        for size, sizes in ((rows, self.batch_buckets), (width, self.width_buckets), (kv_len, self.kv_buckets)):
            i = bisect.bisect_left(sizes, size)
            if i == len(sizes):
                return None
            picks.append(sizes[i])
        return Bucket(*picks)

    def ready_bucket_for(self, rows: int, width: int, kv_len: int) -> Bucket | None:
        """The cheapest compiled bucket that holds the step (fewest padded rows x width x keys), or
        None. Batch, width and keys are not rounded up apart: with buckets (1, 1), (8, 1) and
        (32, 16), a step (4, 3) runs in (32, 16), never in an uncompiled (8, 4)."""
        if kv_len > self.scratch:  # the scratch column must stay outside every real write
            return None
        held = [b for b in list(self.ready)  # one copy: the compile thread adds to it
                if b.batch >= rows and b.width >= width and b.kv >= kv_len]
        return min(held, key=lambda b: (b.batch * b.width * b.kv, b.batch), default=None)

    def _kv_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        layers = self.cache.layers
        if not all(layer.is_initialized for layer in layers):
            self._init_cache()
        return [(layer.keys, layer.values) for layer in layers]

    def _init_cache(self) -> None:
        """Allocate the slot tensors before any prefill (for `warmup`), as the first write would."""
        config: Any = self.model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        empty = torch.empty((1, kv_heads, 0, head_dim), dtype=self.dtype, device=self.device)
        for layer in self.cache.layers:
            if not layer.is_initialized:
                layer.lazy_initialization(empty, empty)

    def _stage_for(self, bucket: Bucket) -> _Staging:
        st = self._staging.get(bucket)
        if st is None:
            pairs = self._kv_pairs()
            if self.static_inputs:
                for k, v in pairs:
                    torch._dynamo.mark_static_address(k)
                    torch._dynamo.mark_static_address(v)
            st = _Staging(bucket, pairs, self.scratch, self.dtype, self.device, self.static_inputs)
            self._staging[bucket] = st
        return st

    # ---- running ----------------------------------------------------------------------------

    def _run(self, st: _Staging) -> tuple[torch.Tensor, torch.Tensor]:
        first = st.compile_s is None
        t0 = time.perf_counter() if first else 0.0
        # Inductor reads its flags when it compiles, i.e. on a bucket's first call; freezing as a
        # `torch.compile` option is not applied. The flags are global: only the thread that
        # compiles (one at a time, `_compile_lock`) sets them, and eager forwards never read them.
        freeze = torch._inductor.config.patch(**self.inductor_options) if first else contextlib.nullcontext()
        with _compile_lock if first else contextlib.nullcontext(), freeze, torch.inference_mode():
            if self.cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            logits, pred = self._fn(self.model, st.ids, st.pos, st.mask, st.cache)
        if first:
            st.compile_s = time.perf_counter() - t0
            self.ready.add(st.bucket)
            self.ready_changes += 1
        st.calls += 1
        return logits, pred

    def warmup(self, buckets: Iterable[Bucket | tuple[int, int, int]]) -> dict[Bucket, float]:
        """Compile these buckets now with an all-padding step (it writes only scratch columns).
        Returns the seconds each first call took (compile included)."""
        out = {}
        for b in buckets:
            bucket = b if isinstance(b, Bucket) else Bucket(*b)
            st = self._stage_for(bucket)
            st.clear()
            first = st.compile_s is None
            self._run(st)
            if first and st.compile_s is not None:
                out[bucket] = st.compile_s
                release_freed_memory()
                st.alone_ms = self._time_alone(st)
        return out

    def _time_alone(self, st: _Staging, calls: int = 5) -> float | None:
        """The median of a few all-padding calls while the engine has no request: what this graph
        costs with the cores to itself, beside which /health shows what the same steps cost served.
        None when the engine stepped meanwhile (that timing would not be alone)."""
        if self.busy:
            return None
        times = []
        with torch.inference_mode():
            for _ in range(calls):
                t0 = time.perf_counter()
                self._fn(self.model, st.ids, st.pos, st.mask, st.cache)
                times.append((time.perf_counter() - t0) * 1000.0)
        return None if self.busy else round(sorted(times)[calls // 2], 3)

    def compile_in_background(self, buckets: Iterable[Bucket | tuple[int, int, int]]) -> threading.Thread:
        """Compile these buckets one by one on a daemon thread while steps run eagerly; each bucket
        runs compiled from the step after it is ready. Each bucket's first call (the compile) writes
        only scratch columns, so it may overlap the engine's steps. While `busy` is set (the engine
        sets it while it has requests) the compile takes `load_share` of the time (0: it waits)."""
        todo = [b if isinstance(b, Bucket) else Bucket(*b) for b in buckets]
        for b in todo:  # staging and the KV tensors are created here, not raced by the thread
            self._stage_for(b)

        throttle = CompileThrottle(self, self.load_share)

        def work() -> None:
            with contextlib.suppress(OSError, AttributeError):  # the compiler's subprocesses too
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            sys.settrace(throttle)  # this thread only
            for b in todo:
                try:
                    seconds = self.warmup([b]).get(b)
                    if seconds is not None:
                        log.warning("compiled decode bucket %s in %.1f s", b, seconds)
                except Exception as exc:  # a bucket that cannot compile keeps running eagerly
                    self.failed[b] = f"{type(exc).__name__}: {exc}"
                    log.exception("compiling decode bucket %s failed; it stays eager", b)

        self._compiler = threading.Thread(target=work, name="compile-decode-buckets", daemon=True)
        self._compiler.start()
        return self._compiler

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a background compile; True once nothing is compiling."""
        if self._compiler is not None:
            self._compiler.join(timeout)
        return self._compiler is None or not self._compiler.is_alive()

    def status(self) -> list[dict]:
        """Every bucket set up: its shape, whether it runs compiled, its compile seconds and calls."""
        return [{"batch": b.batch, "width": b.width, "kv": b.kv, "ready": b in self.ready,
                 "compile_s": None if st.compile_s is None else round(st.compile_s, 1), "calls": st.calls,
                 "alone_ms": st.alone_ms,
                 **({"error": self.failed[b]} if b in self.failed else {})}
                for b, st in list(self._staging.items())]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                cache) -> tuple[torch.Tensor, torch.Tensor]:
        """(greedy next token [B, T], logits [B, T, V]), on the device. The cache is prepared (`prepare_rows` / `prepare_slot`) for
        rows [0, B), mask [B, 1, T, kv_len] with kv_len = cache.kv_len."""
        rows, width = input_ids.shape
        lo, hi = cache.rows
        ours = lo == 0 and hi == rows and cache is self.cache
        kv_len = mask.shape[-1]
        bucket = None if not ours else self.bucket_for(rows, width, kv_len) if self.lazy else \
            self.ready_bucket_for(rows, width, kv_len)
        if bucket is not None and bucket.batch > rows and max(cache.lengths[rows : bucket.batch]) > self.scratch:
            bucket = None  # a padding row's slot holds a token in the scratch column
        if bucket is None:
            return self.eager(input_ids, position_ids, mask, cache)
        st = self._stage_for(bucket)
        if cache.write_start is not None:
            st.stage(input_ids, position_ids, None, cache.write_start, mask, self._arange)
        else:
            st.stage(input_ids, position_ids, cache.write_index, None, mask, self._arange)
        try:
            logits, pred = self._run(st)
        except Exception as exc:  # the step's writes go to the same KV columns eagerly
            self._drop(bucket, exc)
            return self.eager(input_ids, position_ids, mask, cache)
        self.calls += 1
        return pred[:rows, :width], logits[:rows, :width]

    def _drop(self, bucket: Bucket, exc: Exception) -> None:
        """A ready graph that raised runs no more steps: the bucket turns failed (on /health) and
        its steps run in another ready bucket or eagerly."""
        self.ready.discard(bucket)
        self.ready_changes += 1
        self.failed[bucket] = f"{type(exc).__name__}: {exc}"
        self.graph_failures += 1
        log.exception("compiled decode bucket %s raised; its steps run without it from now on", bucket)

    __call__ = forward

    def eager(self, input_ids, position_ids, mask, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """The uncompiled forward (ModelRunner.forward's body), for steps outside every bucket."""
        self.eager_calls += 1
        logits = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, past_key_values=cache,
                            use_cache=True).logits
        return logits.argmax(dim=-1), logits

    def compile_seconds(self) -> dict[Bucket, float]:
        return {b: st.compile_s for b, st in self._staging.items() if st.compile_s is not None}

"""A compiled decode bucket's inputs: the staging buffers allocated once per bucket, and a
transformers Cache over the engine's KV slot tensors at the bucket's batch. A bucket of static
shape pads every step to it (`Staging`, CUDA graphs); a bucket of dynamic shape (CPU) runs each
step at its own key length, and at its own width where the bucket is wider than two, padded in
batch only (`DynamicStaging`). A *prefill* bucket's graph runs a prompt chunk of any one slot:
its row's slot is an input, and attention reads a copy of that slot's keys.

* padding positions (rows >= B, columns >= T) take token 0 at position 0, see key column 0 only
  (a row that sees nothing turns to NaN) and write their keys to the *scratch column*
  `capacity - 1` of their slot, which no committed token occupies (the engine's capacity is
  max_seq_len + max_step_tokens; `CompiledForward.can_run` checks it) and no real write reaches;
* keys and values are written in place into the `BatchKVCache` slot tensors (one index_put per
  layer), and attention reads `keys[:Bb, :, :K]` (K: the bucket's key length, or the step's
  where dynamic), the mask hiding everything past each row's own block.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

NARROW_WIDTH = 4  # the widest `narrow` bucket
# The step widths a ready decode graph is timed at alone (those it holds), for the planner's prices
# (`StepCosts.calibrate`); widths between are interpolated, wider ones extrapolated.
TIMED_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass(frozen=True)
class Bucket:
    batch: int
    width: int
    kv: int
    prefill: bool = False  # a prompt chunk of any one slot (its keys gathered), not the decode rows [0, batch)

    def __str__(self) -> str:
        return f"{'prefill' if self.prefill else 'decode'} ({self.batch}, {self.width}, kv {self.kv})"

    @property
    def dynamic_width(self) -> bool:
        """Its graph, where graphs take dynamic shapes, takes any width in [2, width]."""
        return self.width > 2

    def step_width(self, width: int) -> int:
        """The width a step `width` tokens wide runs at in its graph of dynamic shapes."""
        return max(width, 2) if self.dynamic_width else self.width

    @property
    def narrow(self) -> bool:
        """A decode bucket of dynamic width at most NARROW_WIDTH wide: its graph is compiled at its
        narrowest step."""
        return self.dynamic_width and self.width <= NARROW_WIDTH and not self.prefill

    @property
    def template_gemms(self) -> bool:
        """Its GEMMs take inductor's C++ template only (`inductor_options(template_only=True)`): a
        decode graph of 3 to NARROW_WIDTH rows (one-token steps of 3 or 4 sequences, a narrow
        bucket of one). There oneDNN won autotuning's isolated timings on AVX512 without AMX and
        ran slower inside the forward; at 1 and 2 rows autotuning's own pick, and from 8 rows
        oneDNN, were the faster (docs/BENCHMARKS.md, "GEMM kernels by rows")."""
        return not self.prefill and 2 < self.batch * self.width <= NARROW_WIDTH

    @property
    def tune_width(self) -> int:
        """The width its graph of dynamic width is compiled at: a narrow bucket's narrowest step,
        a wider decode bucket's 8 tokens, a prefill bucket's 32."""
        if self.prefill:
            return min(32, self.width)
        return self.step_width(2 if self.narrow else min(8, self.width))


def _unset(*args: Any) -> Any:
    raise RuntimeError("this bucket has no compiled function yet")


class GraphRecord:
    """A bucket's compiled function and what its graph did: its compile (or cache load) seconds,
    whether it came from the on-disk cache, what a step of each width it runs costs right after
    it (the engine idle), and its calls."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.graph: Callable = _unset  # the bucket's own compiled function (`CompiledForward`)
        self.compile_s: float | None = None
        self.cached: bool | None = None
        self.alone_ms: dict[int, float] = {}  # the width a step runs at in the graph -> ms, timed alone
        self.timed_alone: bool | None = None  # None until its timing ran; False where the engine was stepping
        self.calls = 0

    def timed_widths(self) -> list[int]:
        """The widths its graph is timed at alone: the bucket's own where its shape is static."""
        return [self.bucket.width]

    def pad_view(self, width: int) -> None:
        """All-padding inputs for a step `width` wide (a step then writes only scratch columns)."""
        self.clear()

    def export_dims(self) -> dict[str, dict[int, tuple[str, int, int]]]:
        """{input: {dimension: (size, least, most)}}: the sizes its graph takes any of (none:
        static), one name per size that several inputs share."""
        return {}

    def clear(self) -> None:
        raise NotImplementedError


class Staging(GraphRecord):
    """The static inputs of one bucket, allocated once, and what the last step left in them."""

    def __init__(self, bucket: Bucket, kv_pairs, scratch: int, dtype: torch.dtype, device: torch.device,
                 static: bool) -> None:
        super().__init__(bucket)
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
        self.cache = BucketCache(kv_pairs, self.rows, self.cols, k)

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
              mask: torch.Tensor, arange: torch.Tensor, slot: int = 0) -> None:
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

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, BucketCache]:
        """(ids, positions, mask, KV columns, cache) as the graph takes them."""
        return self.ids, self.pos, self.mask, self.cols, self.cache


Views = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # ids, positions, mask, KV columns


class DynamicStaging(GraphRecord):
    """The inputs of a bucket whose graph takes any key length K in [2, kv] (the key dimension
    marked dynamic) and, when wider than two, any step width T in [2, width] (the width too): each
    step's inputs are views [Bb, T] (mask [Bb, 1, T, K]) of buffers sized once for the widest and
    longest step. A one-token step in a graph of dynamic width runs at T = 2, its second column
    padding. The views of different shapes share memory, so each step writes its view whole: its
    own rows and columns, and padding around them."""

    def __init__(self, bucket: Bucket, kv_pairs, scratch: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(bucket)
        b, t = bucket.batch, bucket.width
        self.max_kv = min(bucket.kv, scratch)  # the scratch column stays outside every view
        self.scratch = scratch
        self.min = torch.finfo(dtype).min
        self._ids = torch.zeros(b * t, dtype=torch.long, device=device)
        self._pos = torch.zeros(b * t, dtype=torch.long, device=device)
        self._cols = torch.full((b * t,), scratch, dtype=torch.long, device=device)
        self._mask = torch.full((b * t * self.max_kv,), self.min, dtype=dtype, device=device)
        # The warm-up's views, at the bucket's tuning width: a graph is tuned at the sizes it is
        # compiled with.
        self._warm = self._mark(self._view(bucket.tune_width, min(256, self.max_kv)))
        self.clear()
        self.rows = torch.arange(b, device=device)[:, None]  # each row's slot
        self.cache = BucketCache(kv_pairs, self.rows, self._warm[3], self.max_kv, gather=bucket.prefill)

    def timed_widths(self) -> list[int]:
        """The widths its graph runs the TIMED_WIDTHS it holds at (a prefill graph: its tuning width)."""
        b = self.bucket
        if b.prefill:
            return [b.tune_width]
        return sorted({b.step_width(w) for w in TIMED_WIDTHS if w <= b.width})

    def pad_view(self, width: int) -> None:
        """All-padding views `width` wide at the warm-up's key length (a prefill graph: its warm-up's)."""
        if self.bucket.prefill:
            self.clear()
            return
        self._views = self._view(width, self._warm[2].shape[-1])
        self._pad(*self._views)

    def export_dims(self) -> dict[str, dict[int, tuple[str, int, int]]]:
        kv = ("keys", 2, self.max_kv)
        if not self.bucket.dynamic_width:
            return {"mask": {3: kv}}
        t = ("width", 2, self.bucket.width)
        return {"ids": {1: t}, "pos": {1: t}, "cols": {1: t}, "mask": {2: t, 3: kv}}

    def _mark(self, views: Views) -> Views:
        """Mark the views the graph is compiled with dynamic: its guards then admit any view whose
        sizes lie in these ranges, so later steps' views go unmarked (~50 us a tensor)."""
        ids, pos, mask, cols = views
        if self.bucket.dynamic_width:
            for x, dim in ((ids, 1), (pos, 1), (cols, 1), (mask, 2)):
                torch._dynamo.mark_dynamic(x, dim, min=2, max=self.bucket.width)
        torch._dynamo.mark_dynamic(mask, 3, min=2, max=self.max_kv)
        return views

    def _view(self, t: int, k: int) -> Views:
        b = self.bucket.batch
        ids, pos, cols = (x[: b * t].view(b, t) for x in (self._ids, self._pos, self._cols))
        return ids, pos, self._mask[: b * t * k].view(b, 1, t, k), cols

    def stage(self, ids: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor | None, start: int | None,
              mask: torch.Tensor, arange: torch.Tensor, slot: int = 0) -> None:
        rows, width = ids.shape
        t, k = self.bucket.step_width(width), mask.shape[-1]
        if self.bucket.prefill:
            self.rows.fill_(slot)
        self._views = vids, vpos, vmask, vcols = self._view(t, k)
        if self.compile_s is None:  # this step compiles the graph (a lazy bucket's first)
            self._mark(self._views)
        vids[:rows, :width].copy_(ids)
        vpos[:rows, :width].copy_(pos)
        if cols is not None:
            vcols[:rows, :width].copy_(cols)
        else:  # one slot written contiguously from `start`
            assert start is not None
            torch.add(arange[:width], start, out=vcols[0, :width])
        vmask[:rows, :, :width].copy_(mask)
        if width < t:
            self._pad(vids[:rows, width:], vpos[:rows, width:], vmask[:rows, :, width:], vcols[:rows, width:])
        if rows < self.bucket.batch:
            self._pad(vids[rows:], vpos[rows:], vmask[rows:], vcols[rows:])

    def _pad(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cols: torch.Tensor) -> None:
        """Padding positions: token 0 at position 0, seeing key column 0 only (a row that sees
        nothing turns to NaN), writing to the scratch column."""
        ids.zero_()
        pos.zero_()
        cols.fill_(self.scratch)
        mask.fill_(self.min)
        mask[..., 0] = 0.0

    def clear(self) -> None:
        """The warm-up's views, all padding (a warm-up step then writes only scratch columns)."""
        self._views = self._warm
        self._pad(*self._warm)

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, BucketCache]:
        """(ids, positions, mask, KV columns, cache) as the graph takes them."""
        return (*self._views, self.cache)


class BucketLayer(CacheLayerMixin):
    """One layer's view of the shared slot tensors at a bucket's shape."""

    is_sliding = False
    is_compileable = True
    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, owner: BucketCache, keys: torch.Tensor, values: torch.Tensor) -> None:
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
        if o.gather:  # a copy of the rows' own slots' keys (a prompt chunk's one slot: small)
            slots = o.rows[:, 0]
            return self.keys[:, :, : o.kv].index_select(0, slots), self.values[:, :, : o.kv].index_select(0, slots)
        return self.keys[: o.batch, :, : o.kv], self.values[: o.batch, :, : o.kv]

    def get_seq_length(self) -> int:
        return self.owner.kv

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv, 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class BucketCache(Cache):
    """A transformers Cache over the engine's slot tensors at a bucket's batch; each call binds
    the step's KV columns and key length (`bind`, inside the compiled step: sizes a graph of
    dynamic shape reads from its inputs)."""

    def __init__(self, kv_pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor, cols: torch.Tensor,
                 kv: int, gather: bool = False) -> None:
        self.rows, self.cols = rows, cols  # [Bb, 1] slot of each row, [Bb, Tb] KV column of each token
        self.batch, self.kv = rows.shape[0], kv
        self.gather = gather  # attention reads the rows' slots, else slots [0, Bb)
        super().__init__(layers=[BucketLayer(self, k, v) for k, v in kv_pairs])

    def bind(self, cols: torch.Tensor, kv) -> None:
        self.cols, self.kv = cols, kv

    def slot_tensors(self) -> list[torch.Tensor]:
        """Each layer's keys then values: the engine's slot tensors this cache writes."""
        return [t for layer in cast("list[BucketLayer]", self.layers) for t in (layer.keys, layer.values)]


def slot_tensors(cache, model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) slot tensors of a `BatchKVCache`, created at the model's KV shape
    if no forward has run yet."""
    layers = cache.layers
    if not all(layer.is_initialized for layer in layers):
        config: Any = model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        empty = torch.empty((1, kv_heads, 0, head_dim), dtype=dtype, device=device)
        for layer in layers:
            if not layer.is_initialized:
                layer.lazy_initialization(empty, empty)
    return [(layer.keys, layer.values) for layer in layers]

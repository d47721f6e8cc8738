"""A compiled decode bucket's inputs: the staging buffers allocated once per bucket, and a
transformers Cache over the engine's KV slot tensors at the bucket's shape. A bucket of static
shape pads every step to it (`Staging`); a bucket of dynamic width runs each step at its own
width, padded in batch and keys only (`WidthStaging`).

* padding positions (rows >= B, columns >= T) take token 0 at position 0, see key column 0 only
  (a row that sees nothing turns to NaN) and write their keys to the *scratch column*
  `capacity - 1` of their slot, which no committed token occupies (the engine's capacity is
  max_seq_len + max_step_tokens; `CompiledForward.can_run` checks it) and no real write reaches;
* keys and values are written in place into the `BatchKVCache` slot tensors (one index_put per
  layer), and attention reads `keys[:Bb, :, :Kb]`, the mask hiding everything past each row's
  own block.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass(frozen=True)
class Bucket:
    batch: int
    width: int
    kv: int


class GraphRecord:
    """What a bucket's graph did: its compile (or cache load) seconds, whether it came from the
    on-disk cache, one call's time right after it (the engine idle), and its calls."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.compile_s: float | None = None
        self.cached: bool | None = None
        self.alone_ms: float | None = None
        self.calls = 0


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

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BucketCache]:
        """(ids, positions, mask, cache) as the graph takes them."""
        return self.ids, self.pos, self.mask, self.cache


class WidthStaging(GraphRecord):
    """The inputs of a bucket whose graph takes any step width T in [2, width] (the width dimension
    marked dynamic): per T, views [Bb, T] (mask [Bb, 1, T, Kb]) of buffers sized for the widest
    step, created once each. A one-token step runs at T = 2, its second column padding. The views
    of different widths share memory, so each step rewrites its view whole."""

    def __init__(self, bucket: Bucket, kv_pairs, scratch: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(bucket)
        b, t, k = bucket.batch, bucket.width, bucket.kv
        self.scratch, self.pairs = scratch, kv_pairs
        self.min = torch.finfo(dtype).min
        self._ids = torch.zeros(b * t, dtype=torch.long, device=device)
        self._pos = torch.zeros(b * t, dtype=torch.long, device=device)
        self._cols = torch.full((b * t,), scratch, dtype=torch.long, device=device)
        self._mask = torch.full((b * t * k,), self.min, dtype=dtype, device=device)
        self.rows = torch.arange(b, device=device)[:, None]
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, BucketCache]] = {}
        self.width = 2  # of the step staged last

    def _at(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BucketCache]:
        views = self._views.get(t)
        if views is None:
            b, k = self.bucket.batch, self.bucket.kv
            ids, pos, cols = (x[: b * t].view(b, t) for x in (self._ids, self._pos, self._cols))
            mask = self._mask[: b * t * k].view(b, 1, t, k)
            for x, dim in ((ids, 1), (pos, 1), (cols, 1), (mask, 2)):
                torch._dynamo.mark_dynamic(x, dim, min=2, max=self.bucket.width)
            views = self._views[t] = (ids, pos, mask, BucketCache(self.pairs, self.rows, cols, k))
        return views

    def stage(self, ids: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor | None, start: int | None,
              mask: torch.Tensor, arange: torch.Tensor) -> None:
        rows, width = ids.shape
        vids, vpos, vmask, cache = self._blank(max(width, 2))
        vcols = cache.cols
        vids[:rows, :width].copy_(ids)
        vpos[:rows, :width].copy_(pos)
        if cols is not None:
            vcols[:rows, :width].copy_(cols)
        else:  # one slot written contiguously from `start`
            assert start is not None
            torch.add(arange[:width], start, out=vcols[0, :width])
        vmask[:rows, :, :width, : mask.shape[-1]].copy_(mask)

    def clear(self) -> None:
        """All padding (a warm-up step then writes only scratch columns), at a width of a typical
        lookahead step: a graph is tuned at the sizes it is compiled with."""
        self._blank(min(8, self.bucket.width))

    def _blank(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BucketCache]:
        """The views of width `t`, all padding; the next call runs at `t`."""
        self.width = t
        views = vids, vpos, vmask, cache = self._at(t)
        vids.zero_()
        vpos.zero_()
        cache.cols.fill_(self.scratch)
        vmask.fill_(self.min)
        vmask[..., 0] = 0.0  # padding queries see column 0 (a row that sees nothing turns to NaN)
        return views

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BucketCache]:
        return self._at(self.width)


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
        return self.keys[: o.batch, :, : o.kv], self.values[: o.batch, :, : o.kv]

    def get_seq_length(self) -> int:
        return self.owner.kv

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv, 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class BucketCache(Cache):
    """A transformers Cache over the engine's slot tensors with a bucket's static shape."""

    def __init__(self, kv_pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor, cols: torch.Tensor,
                 kv: int) -> None:
        self.rows, self.cols = rows, cols  # [Bb, 1] slot of each row, [Bb, Tb] KV column of each token
        self.batch, self.kv = rows.shape[0], kv
        super().__init__(layers=[BucketLayer(self, k, v) for k, v in kv_pairs])


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

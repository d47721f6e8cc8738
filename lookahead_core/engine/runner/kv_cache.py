"""KV memory for a batch of sequences: one preallocated slot per running request."""
from __future__ import annotations

from typing import cast

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class BatchSlotLayer(CacheLayerMixin):
    """Keys and values [max_batch, heads, capacity, head_dim] of one layer.

    A forward covers slots [lo, hi). Each row writes its step at its own offset (`write_index`,
    [rows, T]); attention gets the view [lo:hi, :, :kv_len], never a gathered copy.
    """

    is_sliding = False
    is_compileable = False
    # Set by lazy_initialization, before any use (the base class types them Optional).
    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, owner: BatchKVCache) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        o = self.owner
        self.dtype, self.device = key_states.dtype, key_states.device
        shape = (o.max_batch, key_states.shape[1], o.capacity)
        self.keys = torch.zeros((*shape, key_states.shape[-1]), dtype=self.dtype, device=self.device)
        self.values = torch.zeros((*shape, value_states.shape[-1]), dtype=self.dtype, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        lo, hi = o.rows
        if o.write_start is not None:  # one slot, contiguous write
            s = o.write_start
            t = key_states.shape[-2]
            self.keys[lo, :, s : s + t].copy_(key_states[0])
            self.values[lo, :, s : s + t].copy_(value_states[0])
        else:
            rows, cols = o.write_rows, o.write_index
            self.keys[rows, :, cols] = key_states.transpose(1, 2)
            self.values[rows, :, cols] = value_states.transpose(1, 2)
        return self.keys[lo:hi, :, : o.kv_len], self.values[lo:hi, :, : o.kv_len]

    def get_seq_length(self) -> int:
        return self.owner.kv_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv_len, 0

    def get_max_length(self) -> int:
        return self.owner.capacity


class BatchKVCache(Cache):
    """`max_batch` slots of `capacity` tokens each; `lengths[s]` tokens of slot s are committed.

    The engine keeps running sequences in slots [0, running) so a decode forward reads one view.
    """

    def __init__(self, num_layers: int, max_batch: int, capacity: int, device: torch.device | str = "cpu") -> None:
        self.max_batch = max_batch
        self.capacity = capacity
        self.device = torch.device(device)
        self.lengths = [0] * max_batch
        self.rows = (0, 0)
        self.kv_len = 0
        self.write_start: int | None = None
        self.write_index: torch.Tensor | None = None
        self._row_ids = torch.arange(max_batch, device=self.device)
        self.write_rows = self._row_ids[:0, None]
        super().__init__(layers=[BatchSlotLayer(self) for _ in range(num_layers)])

    def allocate(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Every layer's slot tensors now, rather than at the first forward (compiled graphs take
        them as inputs)."""
        empty = torch.empty((1, kv_heads, 0, head_dim), dtype=dtype, device=self.device)
        for layer in self.slot_layers:
            if not layer.is_initialized:
                layer.lazy_initialization(empty, empty)

    def slot_tensors(self) -> list[torch.Tensor]:
        """Each layer's keys then values."""
        return [t for layer in self.slot_layers for t in (layer.keys, layer.values)]

    @property
    def bytes(self) -> int:
        return sum(t.nbytes for layer in self.slot_layers if layer.is_initialized for t in (layer.keys, layer.values))

    @property
    def slot_layers(self) -> list[BatchSlotLayer]:
        """`layers`, typed: every layer of this cache is a BatchSlotLayer."""
        return cast("list[BatchSlotLayer]", self.layers)

    def prepare_slot(self, slot: int, start: int, tokens: int) -> None:
        """The next forward writes `tokens` tokens of one slot at `start`."""
        if start + tokens > self.capacity:
            raise RuntimeError(f"KV cache overflow: {start + tokens} tokens > capacity {self.capacity}")
        self.rows = (slot, slot + 1)
        self.write_start = start
        self.kv_len = start + tokens

    def prepare_rows(self, hi: int, write_index: torch.Tensor, kv_len: int) -> None:
        """The next forward covers slots [0, hi); row r writes its tokens at write_index[r], which
        starts at the row's committed length."""
        if kv_len > self.capacity:
            raise RuntimeError(f"KV cache overflow: {kv_len} tokens > capacity {self.capacity}")
        if hi == 1:  # one sequence: a contiguous write at its length, no index scatter
            self.prepare_slot(0, self.lengths[0], kv_len - self.lengths[0])
            return
        self.rows = (0, hi)
        self.write_start = None
        self.write_rows = self._row_ids[:hi, None]
        self.write_index = write_index
        self.kv_len = kv_len

    def compact(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move entries (slots[i], src[i]) to (slots[i], dst[i]) in every layer; src > dst."""
        for layer in self.slot_layers:
            if layer.is_initialized:
                layer.keys[slots, :, dst] = layer.keys[slots, :, src]
                layer.values[slots, :, dst] = layer.values[slots, :, src]

    def move_entries(self, slots: list[int], src: list[int], dst: list[int]) -> None:
        """Move entries (slots[i], src[i]) to (slots[i], dst[i]), src[i] >= dst[i]. One slot whose
        src rows are consecutive (a chain of the step's tree) is a slice copy."""
        if slots[0] == slots[-1] and src[-1] - src[0] == len(src) - 1:
            self.move_tokens(slots[0], src[0], dst[0], len(src))
            return
        moves = torch.tensor([slots, src, dst], device=self.device)
        self.compact(moves[0], moves[1], moves[2])

    def move_tokens(self, slot: int, src: int, dst: int, count: int) -> None:
        """Move `count` entries of one slot from `src` to `dst` (a contiguous copy, no index tensors)."""
        if src == dst or count <= 0:
            return
        overlap = src < dst + count
        for layer in self.slot_layers:
            if layer.is_initialized:
                for t in (layer.keys, layer.values):
                    block = t[slot, :, src : src + count]
                    t[slot, :, dst : dst + count].copy_(block.clone() if overlap else block)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy slot `src`'s first `n` entries into slot `dst` (a choice of the same request: the same prompt)."""
        for layer in self.slot_layers:
            if layer.is_initialized:
                layer.keys[dst, :, :n].copy_(layer.keys[src, :, :n])
                layer.values[dst, :, :n].copy_(layer.values[src, :, :n])

    def move_slot(self, src: int, dst: int) -> None:
        """Copy slot `src`'s committed entries into slot `dst` (filling a hole left by a finish)."""
        n = self.lengths[src]
        for layer in self.slot_layers:
            if layer.is_initialized:
                layer.keys[dst, :, :n].copy_(layer.keys[src, :, :n])
                layer.values[dst, :, :n].copy_(layer.values[src, :, :n])
        self.lengths[dst] = n
        self.lengths[src] = 0

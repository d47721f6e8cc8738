"""A transformers Cache over the engine's KV slot tensors, as a compiled step sees them: the rows
[0, B) of the decode slots (or one prompt's slot, gathered), each token's keys written in place at
its own column."""
from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotLayer(CacheLayerMixin):
    """One layer's view of the shared slot tensors."""

    is_sliding = False
    is_compileable = True
    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, owner: SlotCache, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.owner = owner
        self.keys, self.values = keys, values  # [max_batch, heads, capacity, head_dim], shared with the engine
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the slot tensors exist already
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        o = self.owner
        # [B, H, T, D] -> [B, T, H, D]: row r, step token t lands at (rows[r], :, cols[r, t]).
        self.keys[o.rows, :, o.cols] = key_states.transpose(1, 2)
        self.values[o.rows, :, o.cols] = value_states.transpose(1, 2)
        if o.gather:  # a copy of the row's own slot's keys (a prompt chunk's one slot)
            slots = o.rows[:, 0]
            return self.keys[:, :, : o.kv].index_select(0, slots), self.values[:, :, : o.kv].index_select(0, slots)
        batch = o.rows.shape[0]
        return self.keys[:batch, :, : o.kv], self.values[:batch, :, : o.kv]

    def get_seq_length(self) -> int:
        return self.owner.kv

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv, 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class SlotCache(Cache):
    """`rows` [B, 1]: each row's slot; `cols` [B, T]: each token's KV column; `kv`: the keys a step
    attends to (sizes a graph of dynamic shape reads from its inputs). `gather`: attention reads the
    rows' own slots, else slots [0, B)."""

    def __init__(self, kv_pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor, cols: torch.Tensor,
                 kv, gather: bool = False) -> None:
        self.rows, self.cols, self.kv, self.gather = rows, cols, kv, gather
        super().__init__(layers=[SlotLayer(self, k, v) for k, v in kv_pairs])

    def slot_tensors(self) -> list[torch.Tensor]:
        """Each layer's keys then values: the engine's slot tensors this cache writes."""
        return [t for layer in cast("list[SlotLayer]", self.layers) for t in (layer.keys, layer.values)]


def kv_pairs(flat: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[k0, v0, k1, v1, ...] -> [(k0, v0), (k1, v1), ...]."""
    return list(zip(flat[0::2], flat[1::2]))

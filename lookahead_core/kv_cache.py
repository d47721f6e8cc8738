"""A KV cache allocated once per sequence and compacted in place after verification."""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values, [batch, heads, capacity, head_dim], written at the cache's length.

    `update` hands attention a view of the filled prefix plus this step's tokens: no copy, no
    growth. The owning cache moves its length only when a step is committed, so every layer of
    one forward writes at the same offset.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: SlotKVCache, capacity: int) -> None:
        super().__init__()
        self.owner = owner
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.zeros((b, h, self.capacity, dk), dtype=self.dtype, device=self.device)
        self.values = torch.zeros((b, h, self.capacity, dv), dtype=self.dtype, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.owner.length
        end = start + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} tokens > capacity {self.capacity}")
        self.keys[:, :, start:end].copy_(key_states)
        self.values[:, :, start:end].copy_(value_states)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_max_length(self) -> int:
        return self.capacity

    def move(self, src: int, dst: int, count: int) -> None:
        # Callers guarantee src >= dst + count, so the ranges never overlap.
        self.keys[:, :, dst : dst + count].copy_(self.keys[:, :, src : src + count])
        self.values[:, :, dst : dst + count].copy_(self.values[:, :, src : src + count])


class SlotKVCache(Cache):
    """Preallocated cache for one sequence; `length` tokens are committed."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.length = 0
        self.capacity = capacity
        super().__init__(layers=[SlotLayer(self, capacity) for _ in range(num_layers)])

    def commit(self, step_start: int, kept: int, moved_from: int = -1, moved: int = 0) -> None:
        """Keep `kept` tokens of the step written at `step_start`.

        The first step token (the last accepted one) is already in place; `moved` tokens written
        at `moved_from` (the accepted candidate's prefix) are moved right behind it.
        """
        if moved:
            dst = step_start + 1
            if moved_from < dst + moved:
                raise ValueError("accepted candidate rows must lie after their destination")
            if moved_from != dst:
                for layer in self.layers:
                    layer.move(moved_from, dst, moved)
        self.length = step_start + kept

"""Step buffers of the batching engine: ids, positions, KV write offsets and the 4D mask."""
from __future__ import annotations

import numpy as np
import torch


class BatchStepBuffers:
    """Host rows [max_batch, T_max] for ids / positions / KV write offsets, and the mask
    [max_batch, 1, T_max, capacity] on the model's device.

    Mask invariant per slot: columns before the slot's length are 0 (the committed prefix), its
    current step block holds the layout template, everything else is finfo.min. A step only
    rewrites the previous and the new block of each slot.
    """

    def __init__(self, max_batch: int, max_tokens: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.host = torch.zeros((3, max_batch, max_tokens), dtype=torch.long, pin_memory=pinned)
        self.ids, self.pos, self.write_index = self.host.numpy()
        self.dev = self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        self.arange = np.arange(max_tokens, dtype=np.int64)
        self.min = torch.finfo(dtype).min
        self.mask = torch.full((max_batch, 1, max_tokens, capacity), self.min, dtype=dtype, device=device)
        self.blocks = [(0, 0)] * max_batch  # (start, width) of each slot's current block

    def reset_slot(self, slot: int, length: int) -> None:
        """A sequence now occupies `slot` with `length` committed tokens."""
        m = self.mask[slot]
        m.fill_(self.min)
        m[:, :, :length].zero_()
        self.blocks[slot] = (length, 0)

    def write_block(self, slot: int, start: int, template: torch.Tensor, width: int) -> None:
        """Step block of `slot` at column `start`: the template's n rows, then padding rows up to
        `width` that see only themselves (a row that sees nothing would turn to NaN)."""
        m = self.mask[slot, 0]
        prev_start, prev_width = self.blocks[slot]
        if prev_width:
            m[:, prev_start : prev_start + prev_width].fill_(self.min)
        if start > prev_start:
            m[:, prev_start:start].zero_()
        n = template.shape[0]
        m[:n, start : start + n].copy_(template)
        if width > n:
            m[n:width, start + n : start + width].diagonal().zero_()
        self.blocks[slot] = (start, width)

    def write_tree(self, slot: int, row: int, visible: np.ndarray) -> None:
        """Let the candidate tree's rows, from step row `row` of the block just written, see their
        ancestors (the template already gives them the last token and themselves)."""
        k = visible.shape[0]
        col = self.blocks[slot][0] + row
        block = self.mask[slot, 0, row : row + k, col : col + k]
        block.masked_fill_(torch.from_numpy(visible).to(block.device, non_blocking=True), 0.0)

    def to_device(self, rows: int, width: int) -> None:
        if self.dev is not self.host:
            self.dev[:, :rows, :width].copy_(self.host[:, :rows, :width], non_blocking=True)

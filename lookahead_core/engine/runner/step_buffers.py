"""Step buffers of the batching engine: ids, positions, KV write offsets and the 4D mask of a
decode step, and the mask of a prompt chunk."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lookahead_core.engine.step.planner import StepPlan


class BatchStepBuffers:
    """Host rows [max_batch, T_max] for ids / positions / KV write offsets, and the mask
    [max_batch, 1, T_max, capacity] on the model's device.

    Mask invariant per slot: columns before the slot's length are 0 (the committed prefix), its
    current step block holds the layout template, everything else is finfo.min. A step only
    rewrites the previous and the new block of each slot.
    """

    def __init__(self, max_batch: int, max_tokens: int, capacity: int, dtype: torch.dtype, device: torch.device,
                 prefill_chunk: int = 1) -> None:
        pinned = device.type == "cuda"
        self.host = torch.zeros((3, max_batch, max_tokens), dtype=torch.long, pin_memory=pinned)
        self.ids, self.pos, self.write_index = self.host.numpy()
        self.dev = self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        self.arange = np.arange(max_tokens, dtype=np.int64)
        self.min = torch.finfo(dtype).min
        self.mask = torch.full((max_batch, 1, max_tokens, capacity), self.min, dtype=dtype, device=device)
        self.blocks = [(0, 0)] * max_batch  # (start, width) of each slot's current block
        chunk = max(prefill_chunk, 1)
        self.prefill_mask = torch.zeros((1, 1, chunk, capacity), dtype=dtype, device=device)
        self._causal = torch.full((chunk, chunk), self.min, dtype=dtype, device=device).triu_(1)

    def stage(self, plan: StepPlan, lengths: Sequence[int], max_position: int) -> None:
        """The plan's tokens, positions, KV write offsets and masks into the rows of its batch."""
        width = plan.width
        for b, (seq, span, draft) in enumerate(zip(plan.seqs, plan.spans, plan.drafts)):
            n, start = span.width, lengths[b]
            self.ids[b, 0] = seq.tokens[-1]
            if span.ids is not None:
                self.ids[b, 1:n] = span.ids[1:n]
            pos = self.pos[b]
            np.add(span.offsets[:n], start, out=pos[:n])
            if n < width:  # padding rows
                self.ids[b, n:width] = 0
                pos[n:width] = start
            if start + width > max_position:  # a row's offset is below the width
                np.minimum(pos[:width], max_position, out=pos[:width])
            np.add(self.arange[:width], start, out=self.write_index[b, :width])
            self.write_block(b, start, span.template[:n, :n], width)
            if draft is not None and (tree := draft.tree).size > 1:
                self.write_tree(b, span.cand_start, tree.visible[: tree.size, : tree.size])
        self.to_device(plan.batch, width)

    def chunk_mask(self, start: int, n: int) -> torch.Tensor:
        """The mask of a prompt chunk of `n` tokens at positions start..: causal over the chunk, the
        slot's first `start` columns seen; `clear_chunk` undoes it."""
        self.prefill_mask[0, 0, :n, start : start + n].copy_(self._causal[:n, :n])
        return self.prefill_mask[:, :, :n, : start + n]

    def clear_chunk(self, start: int, n: int) -> None:
        self.prefill_mask[0, 0, :n, start : start + n].zero_()

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
        if start > prev_start:  # committed since the last block
            m[:, prev_start:start].zero_()
        if (prev_end := prev_start + prev_width) > (lo := max(start, prev_start)):  # the rest of it: unseen
            m[:, lo:prev_end].fill_(self.min)
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

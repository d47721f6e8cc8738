"""A graph's inputs: buffers allocated once per graph, each step's ids, positions, KV columns and
mask copied in. A dynamic graph (CPU) runs each step at its own batch, width and key count, as
views of buffers sized for its largest (`DynamicStaging`); a static one (CUDA graphs) pads every
step to its shape (`StaticStaging`).

Padding and timing inputs: token 0 at position 0, seeing key column 0 only (a row that sees
nothing turns to NaN), writing its keys to the *scratch column* `capacity - 1` of its slot, which
no committed token occupies (the engine's capacity is max_seq_len + max_step_tokens).
"""
from __future__ import annotations

import torch

from lookahead_core.engine.graphs.buckets import Bucket

Inputs = list[torch.Tensor]  # ids, positions, mask, KV columns, rows' slots, then every layer's keys and values


class DynamicStaging:
    """Inputs of a graph that takes any batch in [1, bucket.batch] (decode), width in [1,
    bucket.width] and key count in [1, bucket.kv]: views [B, T] (mask [B, 1, T, K]) of flat
    buffers sized once. A prefill graph's batch is its one slot."""

    def __init__(self, bucket: Bucket, kv: list[torch.Tensor], scratch: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.bucket, self.kv, self.scratch = bucket, kv, scratch
        b, t = bucket.batch, bucket.width
        self.max_kv = min(bucket.kv, scratch)  # the scratch column stays outside every view
        self.min = torch.finfo(dtype).min
        self._ids = torch.zeros(b * t, dtype=torch.long, device=device)
        self._pos = torch.zeros(b * t, dtype=torch.long, device=device)
        self._cols = torch.full((b * t,), scratch, dtype=torch.long, device=device)
        self._mask = torch.full((b * t * self.max_kv,), self.min, dtype=dtype, device=device)
        self._rows = torch.arange(b, device=device)[:, None]  # decode rows' slots; a prefill's one slot
        self._views = self._view(1, 1, 1)

    def _view(self, b: int, t: int, k: int) -> Inputs:
        ids, pos, cols = (x[: b * t].view(b, t) for x in (self._ids, self._pos, self._cols))
        return [ids, pos, self._mask[: b * t * k].view(b, 1, t, k), cols, self._rows[:b]]

    def stage(self, ids: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor | None, start: int | None,
              mask: torch.Tensor, arange: torch.Tensor, slot: int = 0) -> None:
        """A step's inputs: its KV columns, or one slot written contiguously from `start`."""
        rows, width = ids.shape
        self._views = vids, vpos, vmask, vcols, vrows = self._view(rows, width, mask.shape[-1])
        vids.copy_(ids)
        vpos.copy_(pos)
        if cols is not None:
            vcols.copy_(cols)
        else:
            assert start is not None
            torch.add(arange[:width], start, out=vcols[0])
        vmask.copy_(mask)
        if self.bucket.prefill:
            vrows.fill_(slot)

    def pad(self, batch: int, width: int, kv_len: int) -> None:
        """All-padding inputs of this shape: a call then writes only scratch columns."""
        self._views = ids, pos, mask, cols, rows = self._view(batch, width, kv_len)
        ids.zero_()
        pos.zero_()
        cols.fill_(self.scratch)
        mask.fill_(self.min)
        mask[..., 0] = 0.0
        if self.bucket.prefill:
            rows.fill_(0)

    def probe(self, batch: int, width: int, vocab: int) -> None:
        """The first `width` tokens of a sequence in each of slots [0, batch): varied ordinary
        tokens at positions [0, width), each written at its own column and attending to the
        columns up to it, as a prompt's first tokens do (keys the step did not write, zeros at
        start, make a degenerate state whose logits differ between two correct forwards in bf16).
        The caller keeps and restores those columns: a check of a graph against the eager forward."""
        self.pad(batch, width, width)
        ids, pos, mask, cols, _ = self._views
        ids.copy_((torch.arange(batch * width, device=ids.device).view(batch, width) * 7919 + 1000) % vocab)
        pos.copy_(torch.arange(width, device=pos.device).expand(batch, width))
        cols.copy_(pos)
        mask.copy_(torch.full((width, width), self.min, dtype=mask.dtype, device=mask.device).triu_(1))

    def example(self) -> Inputs:
        """Padding inputs at the sizes a graph is exported with: two or more where a size varies,
        so that no size is taken for a constant."""
        b = self.bucket
        self.pad(min(2, b.batch) if not b.prefill else 1, min(8, b.width), min(256, self.max_kv))
        return self.inputs()

    def export_dims(self) -> dict[str, dict[int, tuple[str, int, int]]]:
        """{input: {dimension: (size, least, most)}}: the sizes the graph takes any of."""
        b = self.bucket
        dims: dict[str, dict[int, tuple[str, int, int]]] = {"ids": {}, "pos": {}, "mask": {}, "cols": {}, "rows": {}}
        if b.batch > 1 and not b.prefill:
            batch = ("batch", 1, b.batch)
            for name in ("ids", "pos", "cols", "rows"):
                dims[name][0] = batch
            dims["mask"][0] = batch
        if b.width > 1:
            width = ("width", 1, b.width)
            for name in ("ids", "pos", "cols"):
                dims[name][1] = width
            dims["mask"][2] = width
        dims["mask"][3] = ("keys", 1, self.max_kv)
        return {k: v for k, v in dims.items() if v}

    def inputs(self) -> Inputs:
        return [*self._views, *self.kv]


class StaticStaging:
    """The inputs of a graph of fixed shape (CUDA graphs), allocated once at fixed addresses; a step
    fills its rows and columns and padding the rest."""

    def __init__(self, bucket: Bucket, kv: list[torch.Tensor], scratch: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.bucket, self.kv, self.scratch = bucket, kv, scratch
        b, t, k = bucket.batch, bucket.width, bucket.kv
        self.ids = torch.zeros((b, t), dtype=torch.long, device=device)
        self.pos = torch.zeros((b, t), dtype=torch.long, device=device)
        self.cols = torch.full((b, t), scratch, dtype=torch.long, device=device)
        self.rows = torch.arange(b, device=device)[:, None]
        self.min = torch.finfo(dtype).min
        self.mask = torch.full((b, 1, t, k), self.min, dtype=dtype, device=device)
        self.mask[..., 0] = 0.0
        for x in (self.ids, self.pos, self.cols, self.rows, self.mask):
            torch._dynamo.mark_static_address(x)

    def _padding(self) -> None:
        self.ids.zero_()
        self.pos.zero_()
        self.cols.fill_(self.scratch)
        self.mask.fill_(self.min)
        self.mask[..., 0] = 0.0

    def stage(self, ids: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor | None, start: int | None,
              mask: torch.Tensor, arange: torch.Tensor, slot: int = 0) -> None:
        rows, width = ids.shape
        self._padding()
        self.ids[:rows, :width].copy_(ids)
        self.pos[:rows, :width].copy_(pos)
        if cols is not None:
            self.cols[:rows, :width].copy_(cols)
        else:
            assert start is not None
            torch.add(arange[:width], start, out=self.cols[0, :width])
        self.mask[:rows, :, :width, : mask.shape[-1]].copy_(mask)

    def pad(self, batch: int, width: int, kv_len: int) -> None:
        self._padding()

    def inputs(self) -> Inputs:
        return [self.ids, self.pos, self.mask, self.cols, self.rows, *self.kv]

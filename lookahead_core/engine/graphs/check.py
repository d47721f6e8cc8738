"""A graph is used only once its first call computes the eager forward's step."""
from __future__ import annotations

import torch

from lookahead_core.engine.graphs.buckets import Bucket
from lookahead_core.engine.graphs.package_store import Run
from lookahead_core.engine.graphs.staging import DynamicStaging, StaticStaging


def logits_differ(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why a graph's logits [B, T, V] are not the eager forward's, or None. float32: every
    position within 1e-3 of its scale. bf16 and fp16 round a fused graph's sums once where the
    eager forward rounds each op, and at a position of outsized activations the two (both a
    float32 forward's neighbours) can differ by a third of the logits' range: three positions
    in four within 5e-2 of their scale."""
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    err = (got - want).abs().amax(-1)
    off = err > tol * want.abs().amax(-1).clamp(min=1.0)
    allowed = 0 if dtype == torch.float32 else off.numel() // 4
    if int(off.sum()) > allowed:
        return (f"its logits differ from the eager forward's by up to {err.max().item():.3g} at "
                f"{int(off.sum())} of {off.numel()} positions")
    return None


@torch.inference_mode()
def check_graph(bucket: Bucket, staging: DynamicStaging | StaticStaging, run: Run, step: torch.nn.Module,
                kv: list[torch.Tensor], vocab_size: int, dtype: torch.dtype) -> str | None:
    """A graph's first call against the eager forward on the same step, the first tokens of a
    sequence in the first slots, whose columns are kept and put back after (a check never changes a
    running sequence's keys): a package that does not compute the served model's step is never
    used. Returns why it is refused, or None."""
    b = bucket
    batch, width = (1, min(4, b.width)) if b.prefill or not b.dynamic else (min(2, b.batch), min(4, b.width))
    if isinstance(staging, DynamicStaging):
        staging.probe(batch, width, vocab_size)
        kept = [t[:batch, :, :width].clone() for t in kv]
    else:
        staging.pad(batch, width, 1)
        kept = []
    inputs = staging.inputs()
    try:
        try:
            logits = run(list(inputs))[0]
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        eager = step(*inputs[:5], inputs[5:])[0]
    finally:
        for t, k in zip(kv, kept):
            t[:batch, :, :width].copy_(k)
    n = min(logits.shape[1], eager.shape[1])
    return logits_differ(logits[:batch, -n:].float(), eager[:batch, -n:].float(), dtype)

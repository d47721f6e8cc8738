"""The value between a step's planning and its forward: who runs, with which draft, in which span."""
from __future__ import annotations

from dataclasses import dataclass

from lookahead_core.engine.sequence import Sequence
from lookahead_core.lookahead.drafter import Draft, Span


@dataclass(frozen=True)
class StepPlan:
    """Batch entry b runs `seqs[b]` with `drafts[b]` (None: plain decoding) as `spans[b]`; every
    span is padded to `width` step rows."""

    seqs: list[Sequence]
    drafts: list[Draft | None]
    spans: list[Span]
    width: int

    @property
    def batch(self) -> int:
        return len(self.seqs)

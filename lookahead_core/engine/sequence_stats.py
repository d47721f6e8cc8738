"""One request's decode figures, reported on its last `StepOutput`."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from lookahead_core.lookahead.pacing import StepKind
from lookahead_core.lookahead.tree import SOURCE_NAMES


@dataclass
class SequenceStats:
    """What one request ran: steps of each kind, rows fed to the model and tokens accepted."""

    prompt_tokens: int
    new_tokens: int = 0
    steps: int = 0
    rows: int = 0  # step rows fed to the model (its own row width, summed over steps)
    steps_by_kind: dict[str, int] = field(default_factory=dict)
    accepted_histogram: dict[int, int] = field(default_factory=dict)
    proposed: dict[str, int] = field(default_factory=dict)  # tree rows each source put in the steps that ran
    accepted_from: dict[str, int] = field(default_factory=dict)  # accepted tree rows, by source

    @property
    def compression(self) -> float:
        """New tokens per decode step (1.0 for plain decoding)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def mean_width(self) -> float:
        return self.rows / self.steps if self.steps else 0.0

    def record(self, kind: StepKind, width: int, accepted: int) -> None:
        self.steps += 1
        self.rows += width
        self.new_tokens += accepted
        name = kind.name.lower()
        self.steps_by_kind[name] = self.steps_by_kind.get(name, 0) + 1
        self.accepted_histogram[accepted] = self.accepted_histogram.get(accepted, 0) + 1

    def record_sources(self, proposed: Seq[int], accepted: Seq[int]) -> None:
        """Tree rows each source (by `Source` value) put in a step that ran, and how many were accepted."""
        for counts, by_source in ((self.proposed, proposed), (self.accepted_from, accepted)):
            for src, count in enumerate(by_source):
                if count:
                    counts[SOURCE_NAMES[src]] = counts.get(SOURCE_NAMES[src], 0) + count

"""What a step may be for one request (plain, the likeliest candidates only, or the whole lookahead
step) and what each kind has been yielding: the state the planner reads."""
from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple


class StepKind(enum.IntEnum):
    PLAIN = 0  # the last token only
    VERIFY = 1  # the last token and the candidate tree's likeliest rows, no lookahead window
    FULL = 2  # the last token, the window and the candidate tree


class Option(NamedTuple):
    """One way a request can run a step: its kind, its width, the tokens it is expected to yield,
    and for VERIFY how many of the tree's likeliest rows it keeps."""

    kind: StepKind
    width: int
    tokens: float
    rows: int | None = None  # None: the whole tree


Menu = list[Option]


@dataclass(frozen=True)
class StepChoice:
    """The kind a request runs this step. `to_beat`: set on a retry of a kind not usually taken,
    the yield it must reach to count as a win. `rows`: the tree rows a VERIFY step keeps (its
    likeliest), None for all."""

    kind: StepKind
    copied: bool = False  # prompt lookup offered a candidate
    to_beat: float | None = None
    rows: int | None = None


class YieldBias:
    """How the tokens wide steps yielded beyond one a row compare with what the plans that picked
    them expected: the width picked is the one whose estimate came out best, so the estimate errs
    high there. A decaying ratio of sums, within [low, high]; `factor` is what an expected token
    beyond a row's first is worth to `batch_width`."""

    def __init__(self, decay: float = 0.98, low: float = 0.5, high: float = 1.25, min_expected: float = 4.0) -> None:
        self.decay, self.low, self.high, self.min_expected = decay, low, high, min_expected
        self.clear()

    def clear(self) -> None:
        self.expected = self.realized = 0.0
        self.factor = 1.0

    def observe(self, expected: float, realized: float) -> None:
        self.expected = self.decay * self.expected + expected
        self.realized = self.decay * self.realized + realized
        if self.expected >= self.min_expected:
            self.factor = min(max(self.realized / self.expected, self.low), self.high)


class FullYields:
    """The tokens whole (FULL) steps yielded across the replica, by (sampled, copied run): where a
    new request's pacer starts, rather than a fixed guess, so a replica whose windows stopped paying
    (sampled text, say) does not widen the batch for every new request to find out again. Starts at
    `prior`, above break-even, so whole steps get tried; the prior counts as one step, and the mean
    is plain until it has seen 1 / `alpha` steps (then a moving average), so a fresh replica learns
    in its first few steps rather than its first hundred."""

    def __init__(self, prior: float = 2.0, alpha: float = 0.05) -> None:
        self.prior, self.alpha = prior, alpha
        self.means: dict[tuple[bool, bool], float] = {}
        self.counts: dict[tuple[bool, bool], int] = {}
        self.clear()

    def clear(self) -> None:
        keys = [(sampled, copied) for sampled in (False, True) for copied in (False, True)]
        self.means = dict.fromkeys(keys, self.prior)
        self.counts = dict.fromkeys(keys, 0)

    def start(self, sampled: bool) -> dict[bool, float]:
        """A new request's expected FULL yield, by copied run."""
        return {copied: self.means[(sampled, copied)] for copied in (False, True)}

    def observe(self, sampled: bool, copied: bool, tokens: int) -> None:
        key = (sampled, copied)
        self.counts[key] += 1
        self.means[key] += max(self.alpha, 1.0 / (self.counts[key] + 1)) * (tokens - self.means[key])


class StepPacer:
    """One request's expected tokens from a whole (FULL) step, learned from its own steps.

    A VERIFY step's yield is known before it runs, from how often rows like its tree's are
    accepted (the planner's `offer`). A FULL step also feeds the window, whose worth shows only in
    later candidates, so its yield is a running mean per whether prompt lookup offered a
    candidate (a copied run is accepted far more often than a pooled n-gram). When FULL is not
    taken it is retried after `min_interval` steps where it fits; the interval doubles up to
    `max_interval` while retries lose, so a window that stopped paying costs at most one wide
    step in `max_interval`, and one that pays again is found.
    """

    def __init__(self, prior: float | Mapping[bool, float] = 2.0, alpha: float = 0.25, min_interval: int = 4,
                 max_interval: int = 64, on_full: Callable[[bool, int], None] | None = None) -> None:
        self.alpha = alpha
        self.min_interval, self.max_interval = min_interval, max_interval
        # FULL's expected yield by copied run: the replica's (`FullYields.start`), or one guess
        self.yields = dict(prior) if isinstance(prior, Mapping) else {c: prior for c in (False, True)}
        self.on_full = on_full  # told each FULL step's (copied, tokens), e.g. `FullYields.observe`
        self.interval = min_interval
        self.idle = 0

    @property
    def due(self) -> bool:
        """A FULL retry is due: that many steps ran without one."""
        return self.idle >= self.interval

    def ran(self, kind: StepKind) -> None:
        """A step of `kind` was planned."""
        self.idle = 0 if kind is StepKind.FULL else self.idle + 1

    def update(self, choice: StepChoice, tokens: int) -> None:
        """What a step of `choice` yielded: `tokens` accepted, bonus included."""
        if choice.kind is not StepKind.FULL:
            return
        self.yields[choice.copied] += self.alpha * (tokens - self.yields[choice.copied])
        if self.on_full is not None:
            self.on_full(choice.copied, tokens)
        if choice.to_beat is not None:
            won = self.yields[choice.copied] > choice.to_beat
            self.interval = self.min_interval if won else min(2 * self.interval, self.max_interval)

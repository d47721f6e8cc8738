"""How wide each step is: per request plain, candidates only, or the whole lookahead step, and
for the batch the width that buys the most tokens per unit of step cost."""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

Menu = list[tuple[int, float]]  # (step width, expected tokens) of each kind a request offers


class StepKind(enum.IntEnum):
    PLAIN = 0  # the last token only
    VERIFY = 1  # the last token and the candidate tree, no lookahead window
    FULL = 2  # the last token, the window and the candidate tree


def batch_width(menus: Sequence[Menu], ratio: Callable[[int], float], floor: int = 1) -> int:
    """The widest row the batch may have this step.

    Rows are padded to the widest, so a step's cost is set by its widest row and every row up to
    that width rides for free. For each width W on offer (at least `floor`, the widest row of
    requests that choose alone), every request takes its most productive kind no wider than W;
    the W with the most expected tokens per unit of cost (`ratio(W)`: against a one-token step)
    wins, the narrower on a tie.
    """
    best_w, best_rate = floor, -1.0
    for w in sorted({width for menu in menus for width, _ in menu if width >= floor} | {floor}):
        total = sum(max((e for width, e in menu if width <= w), default=1.0) for menu in menus)
        rate = total / ratio(w)
        if rate > best_rate * (1 + 1e-9):
            best_w, best_rate = w, rate
    return best_w


class StepPacer:
    """One request's expected tokens per step kind, learned from its own steps.

    A step yields the tokens the request has been accepting on steps of that kind: a running mean
    per (kind, whether prompt lookup offered a candidate), since a copied run is accepted far more
    often than a pooled n-gram. `menu` offers the kinds with their widths; the engine settles the
    batch's width (`batch_width`) and `pick` takes the best kind that fits. A kind not taken is
    tried again after `interval` steps when it fits (or, alone in the batch, even when it widens
    the step); the interval doubles (up to `max_interval`) each time the try does not beat the
    kind it displaced, so what stopped paying costs at most one wide step in `max_interval` and
    what starts paying again is found.
    """

    def __init__(self, prior: float = 2.0, alpha: float = 0.25, min_interval: int = 4, max_interval: int = 64) -> None:
        self.alpha = alpha
        self.min_interval, self.max_interval = min_interval, max_interval
        # tokens per step, by (kind, lookup offered); priors above break-even so each kind gets tried
        self.yield_ = {(k, c): prior for k in (StepKind.VERIFY, StepKind.FULL) for c in (False, True)}
        self.interval = {k: min_interval for k in (StepKind.VERIFY, StepKind.FULL)}
        self.idle = {k: 0 for k in (StepKind.VERIFY, StepKind.FULL)}
        self.kind = StepKind.FULL
        self._widths: dict[StepKind, int] = {}
        self._copied = False
        self._probe, self._to_beat = False, 1.0

    def expected(self, kind: StepKind) -> float:
        return 1.0 if kind is StepKind.PLAIN else self.yield_[kind, self._copied]

    def menu(self, widths: dict[StepKind, int], copied: bool) -> Menu:
        """`widths`: the step width of each kind on offer this step (PLAIN, 1 wide, always is)."""
        self._widths = {StepKind.PLAIN: 1, **widths}
        self._copied = copied
        return [(w, self.expected(k)) for k, w in self._widths.items()]

    def due(self) -> tuple[StepKind, int] | None:
        """The kind whose retry is due this step, with its width."""
        for kind in (StepKind.FULL, StepKind.VERIFY):
            if kind in self._widths and self.idle[kind] >= self.interval[kind]:
                return kind, self._widths[kind]
        return None

    def pick(self, cap: int, ratio: Callable[[int], float], widen: bool = False) -> StepKind:
        """The most productive kind no wider than `cap`, or a due retry that fits (`widen`: even
        one that does not, for a request alone in its step)."""
        fits = [k for k, w in self._widths.items() if w <= cap]
        best = max(fits, key=lambda k: (self.expected(k), -self._widths[k]))
        self._probe = False
        if (due := self.due()) is not None and due[0] is not best and (widen or due[1] <= cap):
            kind, width = due
            # the retry must beat what it displaced at the retry's own cost
            self._to_beat = self.expected(best) * ratio(width) / ratio(self._widths[best])
            best, self._probe = kind, True
        for kind in self.idle:
            self.idle[kind] = 0 if kind is best else self.idle[kind] + 1
        self.kind = best
        return best

    def choose(self, widths: dict[StepKind, int], copied: bool, ratio: Callable[[int], float]) -> StepKind:
        """Pick alone, as the only row of a step (a request whose choice must not depend on others)."""
        return self.pick(batch_width([self.menu(widths, copied)], ratio), ratio, widen=True)

    def update(self, tokens: int) -> None:
        """What the step of the picked kind yielded: `tokens` accepted, bonus included."""
        kind = self.kind
        if kind is StepKind.PLAIN:
            return
        key = (kind, self._copied)
        self.yield_[key] += self.alpha * (tokens - self.yield_[key])
        if self._probe:
            won = self.yield_[key] > self._to_beat
            self.interval[kind] = self.min_interval if won else min(2 * self.interval[kind], self.max_interval)

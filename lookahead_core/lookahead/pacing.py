"""How wide each step is: per request plain, candidates only, or the whole lookahead step, and
for the batch the width that buys the most tokens per unit of step cost."""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class StepKind(enum.IntEnum):
    PLAIN = 0  # the last token only
    VERIFY = 1  # the last token and the candidate tree, no lookahead window
    FULL = 2  # the last token, the window and the candidate tree


Menu = dict[StepKind, tuple[int, float]]  # kind -> (step width, expected tokens)


@dataclass(frozen=True)
class StepChoice:
    """The kind a request runs this step. `to_beat`: set on a retry of a kind not usually taken,
    the yield it must reach to count as a win."""

    kind: StepKind
    copied: bool = False  # prompt lookup offered a candidate
    to_beat: float | None = None


def batch_width(menus: Sequence[Menu], ratio: Callable[[int], float], floor: int = 1,
                fits_slo: Callable[[int, float], bool] | None = None) -> int:
    """The widest row the batch may have this step.

    Rows are padded to the widest, so a step's cost is set by its widest row and every row up to
    that width rides for free. For each width W on offer (at least `floor`, the widest row of
    requests that do not pace), every request takes its most productive kind no wider than W; the
    W with the most expected tokens per unit of cost (`ratio(W)`: against a one-token step) wins,
    the narrower on a tie. `fits_slo(W, tokens per row)` may rule out widths above the floor.
    """
    best_w, best_rate = floor, -1.0
    for w in sorted({width for menu in menus for width, _ in menu.values() if width >= floor} | {floor}):
        total = sum(max((e for width, e in menu.values() if width <= w), default=1.0) for menu in menus)
        if w > floor and fits_slo is not None and menus and not fits_slo(w, total / len(menus)):
            continue
        rate = total / ratio(w)
        if rate > best_rate * (1 + 1e-9):
            best_w, best_rate = w, rate
    return best_w


class StepPacer:
    """One request's expected tokens per step kind, learned from its own steps.

    A kind yields the tokens the request has been accepting on its steps: a running mean per
    (kind, whether prompt lookup offered a candidate), since a copied run is accepted far more
    often than a pooled n-gram. A kind not taken is retried after `min_interval` steps when it
    fits; the interval doubles up to `max_interval` while retries lose, so what stopped paying
    costs at most one wide step in `max_interval`, and what pays again is found.
    """

    def __init__(self, prior: float = 2.0, alpha: float = 0.25, min_interval: int = 4, max_interval: int = 64) -> None:
        self.alpha = alpha
        self.min_interval, self.max_interval = min_interval, max_interval
        # priors above break-even, so each kind gets tried
        self.yields = {(k, c): prior for k in (StepKind.VERIFY, StepKind.FULL) for c in (False, True)}
        self.interval = {k: min_interval for k in (StepKind.VERIFY, StepKind.FULL)}
        self.idle = {k: 0 for k in (StepKind.VERIFY, StepKind.FULL)}

    def menu(self, widths: dict[StepKind, int], copied: bool) -> Menu:
        """Each kind on offer (`widths`; PLAIN, 1 wide, always is) with the tokens it is expected to yield."""
        menu = {StepKind.PLAIN: (1, 1.0)}
        for kind, width in widths.items():
            if kind is not StepKind.PLAIN:
                menu[kind] = (width, self.yields[kind, copied])
        return menu

    def pick(self, menu: Menu, copied: bool, cap: int, ratio: Callable[[int], float], widen: bool = False) -> StepChoice:
        """The most productive kind no wider than `cap`, or a due retry that fits (`widen`: even
        one that does not, for a request alone in its step)."""
        fits = [k for k, (w, _) in menu.items() if w <= cap]
        best = max(fits, key=lambda k: (menu[k][1], -menu[k][0]))
        choice = StepChoice(best, copied)
        for kind in (StepKind.FULL, StepKind.VERIFY):
            if kind in menu and kind is not best and self.idle[kind] >= self.interval[kind] and (widen or menu[kind][0] <= cap):
                # the retry must beat what it displaced at the retry's own cost
                to_beat = menu[best][1] * ratio(menu[kind][0]) / ratio(menu[best][0])
                choice = StepChoice(kind, copied, to_beat)
                break
        for kind in self.idle:
            self.idle[kind] = 0 if kind is choice.kind else self.idle[kind] + 1
        return choice

    def choose(self, widths: dict[StepKind, int], copied: bool, ratio: Callable[[int], float]) -> StepChoice:
        """Pick alone, as the only row of a step."""
        menu = self.menu(widths, copied)
        return self.pick(menu, copied, batch_width([menu], ratio), ratio, widen=True)

    def update(self, choice: StepChoice, tokens: int) -> None:
        """What a step of `choice` yielded: `tokens` accepted, bonus included."""
        if choice.kind is StepKind.PLAIN:
            return
        key = (choice.kind, choice.copied)
        self.yields[key] += self.alpha * (tokens - self.yields[key])
        if choice.to_beat is not None:
            won = self.yields[key] > choice.to_beat
            self.interval[choice.kind] = self.min_interval if won else min(2 * self.interval[choice.kind], self.max_interval)

"""The one owner of a step's width: the price of a row, each request's menu from its draft, one rule picks."""
from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from lookahead_core.engine.step.costs import batch_bucket
from lookahead_core.engine.step.prices import Prices
from lookahead_core.engine.step.sequence import Sequence as Running
from lookahead_core.lookahead.drafter import Draft, Span
from lookahead_core.lookahead.pacing import Menu, Option, StepChoice, StepKind, StepPacer, YieldBias


def step_menu(full_width: int | None, verify: Sequence[tuple[int, float]], full_tokens: float) -> Menu:
    """PLAIN, each VERIFY option (tree rows kept, expected tokens) and FULL at `full_width`."""
    menu = [Option(StepKind.PLAIN, 1, 1.0)]
    menu += [Option(StepKind.VERIFY, 1 + rows, tokens, rows) for rows, tokens in verify]
    if full_width is not None:
        menu.append(Option(StepKind.FULL, full_width, full_tokens))
    return menu


def best_option(menu: Menu, cap: int) -> Option:
    """The option no wider than `cap` expected to yield the most tokens, the narrower on a tie."""
    return max((o for o in menu if o.width <= cap), key=lambda o: (o.tokens, -o.width))


def batch_width(menus: Sequence[Menu], ratio: Callable[[int], float], floor: int = 1,
                fits_slo: Callable[[int, float], bool] | None = None, rest: float = 0.0, bias: float = 1.0) -> int:
    """The widest row the batch may have this step.

    Rows are padded to the widest, so a step's cost is set by its widest row and every row up to
    that width rides for free. For each width W on offer (at least `floor`, the widest row of
    requests that do not pace), every request takes its most productive option no wider than W;
    the W with the most expected tokens per unit of cost (`ratio(W)`: against a one-token step)
    wins, the narrower on a tie. `rest`: the tokens the batch's rows outside `menus` yield at any
    width (they pay the wider step too); `bias`: what an expected token beyond a row's first is
    worth (`YieldBias.factor`). `fits_slo(W, least)` may rule out widths above the floor, given
    the fewest tokens a menu's row yields at W.
    """
    # per menu: its widths ascending and the most tokens an option up to each width yields
    ladders = []
    for menu in menus:
        opts = sorted(menu, key=lambda o: o.width)
        widths, best, top = [], [], 1.0
        for o in opts:
            top = max(top, o.tokens)
            widths.append(o.width)
            best.append(top)
        ladders.append((widths, best))
    best_w, best_rate = floor, -1.0
    for w in sorted({o.width for menu in menus for o in menu if o.width >= floor} | {floor}):
        total, least = rest, float("inf")
        for widths, best in ladders:
            i = bisect.bisect_right(widths, w)
            tokens = 1.0 + bias * (best[i - 1] - 1.0) if i else 1.0
            total, least = total + tokens, min(least, tokens)
        if w > floor and fits_slo is not None and menus and not fits_slo(w, least):
            continue
        rate = total / ratio(w)
        if rate > best_rate * (1 + 1e-9):
            best_w, best_rate = w, rate
    return best_w


def pick(pacer: StepPacer, menu: Menu, copied: bool, cap: int, ratio: Callable[[int], float],
         widen: bool = False) -> StepChoice:
    """A paced request's option: the most productive no wider than `cap`, or a FULL retry its pacer
    has due that fits (`widen`: even one that does not, for a request alone in its step)."""
    best = best_option(menu, cap)
    choice = StepChoice(best.kind, copied, rows=best.rows)
    full = next((o for o in menu if o.kind is StepKind.FULL), None)
    if full is not None and best.kind is not StepKind.FULL and pacer.due and (widen or full.width <= cap):
        # the retry must beat what it displaced at the retry's own cost
        choice = StepChoice(StepKind.FULL, copied, best.tokens * ratio(full.width) / ratio(best.width))
    pacer.ran(choice.kind)
    return choice


@dataclass(frozen=True)
class Offer:
    """A request's menu for this step: one width it takes (plain, or a fixed (N, W, G) whole, with
    its menu for when the SLO rules that out), or the kinds its `pacer` paces over."""

    width: int
    menu: Menu | None = None
    pacer: StepPacer | None = None
    copied: bool = False
    full_rows: int | None = None  # the tree rows a whole step keeps


def offer(draft: Draft | None, row_price: float) -> Offer:
    """A draft's menu: a whole step keeps the tree rows accepted at least as often as `row_price`
    (what one more row costs, in one-token steps); a step without the window keeps the m likeliest
    rows, for any m, expecting the bonus token plus their chances."""
    if draft is None:
        return Offer(1)
    full_rows = int(np.count_nonzero(draft.odds >= row_price))
    full = draft.full_start + full_rows
    verify = [(m + 1, float(e)) for m, e in enumerate(1.0 + np.cumsum(draft.odds))]
    menu = step_menu(full, verify, draft.full_tokens)
    return Offer(full if draft.pacer is None else 1, menu, draft.pacer, draft.copied, full_rows)


class StepPlanner:
    """Settles the batch's widest row and each row's kind from measured step costs.

    Requests that pace offer their kinds with the tokens they expect (their own running
    acceptance). Plain requests take width 1; a fixed (N, W, G) (`adapt` off) takes its whole
    step, which sets a floor every other row rides up to for free, as long as that step keeps
    every row's predicted time per output token within `slo_tpot_ms` (a row yielding one token
    waits the whole step: another row's yield does not pay for it); past it, a fixed row is priced
    like a paced one, so no request can widen anyone's step beyond the SLO. A plan's `Prices` are
    those of the batch the queue would fill (running + waiting, up to `max_batch`), and the SLO
    caps every width above the narrowest the batch can run. A menu's expected tokens beyond one
    are discounted by how far wide steps fell short of their plans (`bias`, learned in `learn`).
    """

    def __init__(self, max_batch: int, slo_tpot_ms: float | None = None, row_price: float | None = None,
                 bias: YieldBias | None = None, max_pause: int = 16) -> None:
        self.max_batch = max_batch
        self.slo_tpot_ms = slo_tpot_ms
        self.pinned_price = row_price  # as if a row cost this on any machine (tests, benchmarks of tokens per step)
        self.max_pause = max_pause
        self._pause: dict[int, tuple[int, int]] = {}  # per batch bucket: (steps left, last pause)
        self.bias = bias or YieldBias()  # the replica's, in its ReplicaKnowledge
        self._expected: list[tuple[int, float]] = []  # the last wide plan's paced rows: (row, tokens expected)

    def drafts_due(self, requests: int) -> bool:
        """Whether the requests draft this step. Where the last plan at this batch kept every row
        plain, drafting pauses for 1, 2, 4, ... up to `max_pause` steps while plans keep doing so:
        a batch's drafts cost host time on every step, repaid only by a step that widens. A request
        alone always drafts: its draft is a small share of its step, and a copied run can start at
        any token. An engine with nothing to decode starts over (`idle`)."""
        bucket = batch_bucket(min(self.max_batch, requests))
        if bucket == 0:
            return True
        left, last = self._pause.get(bucket, (0, 0))
        if left:
            self._pause[bucket] = (left - 1, last)
        return not left

    def batch(self, requests: int) -> int:
        """The batch whose prices a plan reads: what the queue would fill."""
        return min(self.max_batch, requests)

    def row_price(self, prices: Prices) -> float:
        """The price of one more row per request, in one-token steps (measured, unless pinned):
        candidates accepted less often than this do not earn their row."""
        return prices.row_price if self.pinned_price is None else self.pinned_price

    def plan(self, drafts: Sequence[Draft | None], row_price: float, prices: Prices) -> list[StepChoice]:
        """Each request's kind and, for a step with a tree, the likeliest tree rows it keeps."""
        offers = [offer(d, row_price) for d in drafts]
        batch, ratio = prices.batch, prices.ratio

        def fits_slo(width: int, least: float) -> bool:
            """Whether every row's time per token fits: `least`, the fewest tokens a row yields."""
            ms = prices.estimate_ms(width)
            return ms is None or self.slo_tpot_ms is None or ms / max(least, 1.0) <= self.slo_tpot_ms

        floor = max((o.width for o in offers if o.pacer is None), default=1)
        priced = [o for o in offers if o.pacer is not None]
        outside = [o for o in offers if o.pacer is None]
        if floor > 1 and self.slo_tpot_ms is not None and not fits_slo(floor, min(_tokens_at(offers, floor))):
            floor, priced = 1, [o for o in offers if o.menu is not None]
            outside = [o for o in offers if o.menu is None]
        menus = [o.menu for o in priced if o.menu is not None]
        at_floor = _tokens_at(outside, floor)  # they pay a wider step too
        rest, least = sum(at_floor), min(at_floor, default=float("inf"))

        def fits_batch(width: int, least_in_menus: float) -> bool:
            return fits_slo(width, min(least_in_menus, least))  # rows outside the menus wait the step too

        cap = batch_width(menus, ratio, floor, fits_batch if self.slo_tpot_ms else None, rest,
                          self.bias.factor) if menus else floor
        widen = len(offers) == 1  # alone: a retry may widen the step, nobody else pays for it
        choices = [_choice(o, cap, ratio, widen) for o in offers]
        self._expected = [(b, best_option(o.menu, cap).tokens) for b, o in enumerate(offers)
                          if o.pacer is not None and o.menu is not None] if cap > 1 else []
        bucket = batch_bucket(batch)
        if bucket and any(d is not None for d in drafts):  # a request alone never pauses (drafts_due)
            last = self._pause.get(bucket, (0, 0))[1]
            pause = min(2 * last or 1, self.max_pause) if all(c.kind is StepKind.PLAIN for c in choices) else 0
            self._pause[bucket] = (pause, pause)
        return choices

    def idle(self) -> None:
        """Nothing decodes: the next batch drafts from its first step."""
        self._pause.clear()

    def learn(self, tokens: Sequence[int]) -> None:
        """What the last plan's rows yielded (`tokens[b]`: row b's accepted tokens, bonus included),
        against what it expected of its paced rows at the width it picked."""
        if self._expected:
            self.bias.observe(sum(e - 1.0 for _, e in self._expected), sum(tokens[b] - 1 for b, _ in self._expected))
            self._expected = []


def _tokens_at(offers: Sequence[Offer], width: int) -> list[float]:
    """The tokens each row's step of `width` is expected to yield: a fixed row its whole step's,
    a paced one its best option that fits, a plain one 1."""
    return [1.0 if o.menu is None else next(opt.tokens for opt in o.menu if opt.kind is StepKind.FULL)
            if o.pacer is None else best_option(o.menu, width).tokens for o in offers]


def _choice(o: Offer, cap: int, ratio, widen: bool) -> StepChoice:
    """A whole step keeps the offer's `full_rows`, a VERIFY step its option's rows."""
    if o.pacer is not None:
        assert o.menu is not None  # a paced offer carries its menu
        c = pick(o.pacer, o.menu, o.copied, cap, ratio, widen)
        return StepChoice(StepKind.FULL, c.copied, c.to_beat, o.full_rows) if c.kind is StepKind.FULL else c
    if o.menu is None:
        return StepChoice(StepKind.PLAIN if o.width == 1 else StepKind.FULL)
    if o.width <= cap:
        return StepChoice(StepKind.FULL, o.copied, rows=o.full_rows)
    best = best_option(o.menu, cap)  # a fixed row the SLO does not let run whole
    return StepChoice(best.kind, o.copied, rows=best.rows)


@dataclass(frozen=True)
class StepPlan:
    """Batch entry b runs `seqs[b]` with `drafts[b]` (None: plain decoding) as `spans[b]`; every
    span is padded to `width` step rows."""

    seqs: list[Running]
    drafts: list[Draft | None]
    spans: list[Span]
    width: int

    @property
    def batch(self) -> int:
        return len(self.seqs)

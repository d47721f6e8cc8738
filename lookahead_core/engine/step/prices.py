"""What a step of each width is expected to cost, from the measured table and the priors for what
it has not settled; one `Prices` value per plan is what the planner reads."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from lookahead_core.engine.step.costs import CostTable, batch_bucket


@dataclass(frozen=True)
class Prices:
    """A plan's prices at one batch size: `ratio(width)`, a step of `width` tokens per row against
    a one-token step; `estimate_ms(width)`, its expected milliseconds (None: nothing known yet);
    `row_price`, what one more token per row costs, in one-token steps."""

    batch: int
    row_price: float
    ratio: Callable[[int], float]
    estimate_ms: Callable[[int], float | None]


class StepCosts(CostTable):
    """The table's cells priced, with priors for what has not settled.

    `ratio(batch, width)` is what a step `width` tokens wide costs against a one-token step. A
    width not yet settled is priced by a prior: the widest settled narrower width plus, per token
    beyond it, the bucket's `slope` learned from the wide widths run so far (`prior_slope` before
    any), so it gets tried where that says it pays, and then measured (where width is dear, a cheap
    prior had every width tried in turn, each costing far more than it was priced at). A wide cell
    with fewer than `settle` forwards is blended with the prior (CPU timings err slow: one
    preempted forward must not price a width out before it was tried again). Where the compiled
    graphs were timed alone (`calibrate`), that is the prior instead: a width not settled costs its
    timed ratio to a one-token step times the one-token cost measured now, times what the bucket's
    other wide widths cost served against their own timed price (`served_factor`).
    """

    def __init__(self, alpha: float = 0.1, prior_slope: float = 0.05, settle: int = 8, clip: float = 2.0,
                 stale: int = 512) -> None:
        super().__init__(alpha, settle, clip, stale)
        self.prior_slope = prior_slope
        # derived once per table version: a plan prices every width on offer
        self._priors: dict[tuple[int, int], float] = {}  # prior_ms per (bucket, width)
        self._ones: dict[int, float] = {}  # one_token_ms per bucket
        self._excess: dict[int, dict[int, tuple[float, int]]] = {}  # per bucket: width -> (served/timed, n)
        self._priors_at = (-1, -1)  # (observed, version) they were derived at

    def prices(self, batch: int) -> Prices:
        """This batch size's prices, for one plan."""
        return Prices(batch, self.row_price(batch), partial(self.ratio, batch), partial(self.estimate_ms, batch))

    def _ratio_prior(self, batch: int, width: int) -> float:
        """A width's cost against a one-token step before it settles: timed, else `prior_ratio`."""
        timed = self.timed_ratio(batch, width)
        return self.prior_ratio(width) if timed is None else timed

    def ms(self, batch: int, width: int) -> float | None:
        """The measured cost of this cell once settled; before, its timings blended with the prior
        (`prior_ms`); None before anything of this batch bucket ran."""
        bucket = batch_bucket(batch)
        value = self._ms.get((bucket, width))
        n = self._fresh_n((bucket, width)) if value is not None else 0
        if value is not None and (width == 1 or n >= self.settle):
            return value
        prior = self.prior_ms(batch, width)
        if prior is None or value is None:
            return prior
        return (n * value + (self.settle - n) * prior) / self.settle

    def prior_ms(self, batch: int, width: int) -> float | None:
        """What a width not yet settled is expected to cost: a one-token step times its timed ratio
        (`calibrate`); else the widest settled narrower width (a one-token step at least) plus, per
        token beyond it, `slope` one-token steps (learned from the other wide widths: a cell's own
        first timings must not price it out)."""
        bucket = batch_bucket(batch)
        one = self.one_token_ms(batch)
        if one is None:
            return None
        self._per_forward()
        key = (bucket, width)
        if key not in self._priors and (timed := self.timed_ratio(batch, width)) is not None:
            self._priors[key] = one * timed * self.served_factor(bucket, exclude=width)
        elif key not in self._priors:
            settled = self._settled(bucket)
            below_w, below = next(((w, v) for w, v in reversed(settled) if w < width), (1, one))
            self._priors[key] = max(below, one) + one * self.slope(bucket, exclude=width) * (width - below_w)
        return self._priors[key]

    def served_factor(self, bucket: int, exclude: int | None = None) -> float:
        """How far this bucket's wide steps cost served above their timed ratio to a one-token step
        served: the mean over its fresh wide cells but `exclude`, weighted by forwards (up to
        `settle`), at least 1.0 (a brake only: a few fast first timings must not make every width
        look cheap); 1.0 before any. Under load a wide graph can cost far more than it did alone
        (its threads preempted, its weights evicted by the other graph's), and then every width
        not yet run would be tried at the timed price, each a handful of dear steps."""
        self._per_forward()
        cells = self._excess.get(bucket)
        if cells is None:
            one = self.one_token_ms(1 << bucket)
            cells = self._excess[bucket] = {} if not one else {
                w: (v / (one * timed), min(n, self.settle)) for (b, w), v in list(self._ms.items())
                if b == bucket and w > 1 and (n := self._fresh_n((b, w)))
                and (timed := self.timed_ratio(1 << bucket, w)) is not None}
        others = [fn for w, fn in cells.items() if w != exclude]
        if not others:
            return 1.0
        return max(sum(f * n for f, n in others) / sum(n for _, n in others), 1.0)

    def slope(self, bucket: int, exclude: int | None = None) -> float:
        """What one more token per row costs at this batch bucket, in one-token steps, from every
        fresh cell at least two wide but `exclude`, settled or not (the step from one token to two
        may cost more than its width says: it can leave a one-token graph for a wider one): their
        least-squares slope weighted by forwards, so one noisy cell cannot flatten it; one such cell's rise from a
        one-token step; `prior_slope` before any. Learned from the first wide forwards, so where
        width is dear the widths beyond are priced dear before each is tried."""
        one = self.one_token_ms(1 << bucket)
        cells = [(w, v, min(n, self.settle)) for (b, w), v in list(self._ms.items())
                 if b == bucket and w > 1 and w != exclude and (n := self._fresh_n((b, w)))]
        if not one or not cells:
            return self.prior_slope
        if len(cells) == 1:
            (w, v, _), = cells
            return max((v - one) / (w - 1) / one, 0.0)
        # weighted by forwards (up to `settle`): a width timed once counts less than a settled one
        total = sum(n for _, _, n in cells)
        mean_w = sum(w * n for w, _, n in cells) / total
        mean_v = sum(v * n for _, v, n in cells) / total
        spread = sum(n * (w - mean_w) ** 2 for w, _, n in cells)
        rise = sum(n * (w - mean_w) * (v - mean_v) for w, v, n in cells) / spread
        return max(rise / one, 0.0)

    def prior_ratio(self, width: int) -> float:
        return 1.0 + self.prior_slope * (width - 1)

    def one_token_ms(self, batch: int) -> float | None:
        """A one-token step's cost at this batch size: measured, or else inferred from the narrowest
        measured width through the prior (a bucket whose rows never all run plain still gets a
        price), or before any forward as its graph was timed alone; never above a settled wider
        width's (a first timing that erred slow lingers in a cell that lookahead steps seldom
        re-measure, and would make every width look free)."""
        bucket = batch_bucket(batch)
        width = self._narrowest.get(bucket)
        if width is None:
            timed = self._timed.get(bucket)
            return timed[1][0] if timed is not None else None
        self._per_forward()
        one = self._ones.get(bucket)
        if one is None:
            one = self._ms[bucket, width] / self._ratio_prior(batch, width)
            one = self._ones[bucket] = min([one, *(v for w, v in self._settled(bucket) if w > width)])
        return one

    def _per_forward(self) -> None:
        """A step's plan prices every width on offer: priors and one-token costs once per forward."""
        if self._priors_at != (self.observed, self.version):
            self._priors.clear()
            self._ones.clear()
            self._excess.clear()
            self._priors_at = (self.observed, self.version)

    def ratio(self, batch: int, width: int) -> float:
        """Cost of a step of `width` tokens per row against a step of one, at this batch size."""
        if width <= 1:
            return 1.0
        one = self.one_token_ms(batch)
        wide = self.ms(batch, width)
        if one is None or wide is None:
            return self._ratio_prior(batch, width)
        return max(wide / one, 1.0)

    def row_price(self, batch: int) -> float:
        """What one more token per row costs, in one-token steps: the mean slope from one token
        to the widest step measured at this batch size, or before one the widest timed alone (0
        before either)."""
        bucket = batch_bucket(batch)
        widest = self._widest.get(bucket, 1)
        if widest <= 1 and (timed := self._nearest_timed(bucket)) is not None:
            widest = timed[0][-1]
        return 0.0 if widest <= 1 else (self.ratio(batch, widest) - 1.0) / (widest - 1)

    def estimate_ms(self, batch: int, width: int) -> float | None:
        """What a step of this batch and width is expected to take, for the SLO: a width never
        measured at least at its timed ratio or the prior's slope, a batch size never run at
        least at the largest smaller one's one-token cost; None before any forward ran (or graph
        was timed) at this batch size or below."""
        bucket = batch_bucket(batch)
        below = [b for b in {*self._narrowest, *self._timed} if b <= bucket]
        if not below:
            return None
        if max(below) < bucket:  # more rows never cost less
            return self.one_token_ms(1 << max(below)) * self.prior_ratio(width)  # type: ignore[operator]
        ratio = self.ratio(batch, width)
        if self.measured(batch, width) is None:
            ratio = max(ratio, self._ratio_prior(batch, width))
        return self.one_token_ms(batch) * ratio  # type: ignore[operator]

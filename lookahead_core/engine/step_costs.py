"""What a decode forward costs on this machine, learned from the forwards the engine runs."""
from __future__ import annotations

import bisect
from collections.abc import Mapping


def batch_bucket(batch: int) -> int:
    """Batch sizes are pooled by powers of two: 1, 2, 3-4, 5-8, ..."""
    return max(batch - 1, 0).bit_length()


class StepCosts:
    """Running mean of decode-forward milliseconds per (batch bucket, tokens per row).

    The cost of widening a step is a property of the machine, the model and its dtype, and it
    drifts (other load, clocks), so it is measured on every step rather than read from a file.
    `ratio(batch, width)` is what a step `width` tokens wide costs against a one-token step.
    A width not yet settled is priced by a prior: the widest settled narrower width plus, per
    token beyond it, the bucket's `slope` learned from the wide widths run so far (`prior_slope`
    before any), so it gets tried where that says it pays, and then measured (where width is dear,
    a cheap prior had every width tried in turn, each costing far more than it was priced at).
    A wide cell with fewer than `settle` forwards is blended with the prior (CPU timings err slow:
    one preempted forward must not price a width out before it was tried again). For the same
    reason a forward counts at most `clip` times its cell's mean, and a cell not run in the last
    `stale` forwards is priced by the prior again, so it gets tried and re-measured: a width priced
    out under a burst of load is not priced out for good.
    Where the compiled graphs were timed alone (`calibrate`), that is the prior instead: a width
    not settled costs its timed ratio to a one-token step times the one-token cost measured now,
    so no width is run to find out what its graph already showed, times what the bucket's other
    wide widths cost served against their own timed price (`served_factor`).
    One cell per (bucket, width) the engine can run: the state is bounded by its limits.
    """

    def __init__(self, alpha: float = 0.1, prior_slope: float = 0.05, settle: int = 8, clip: float = 2.0,
                 stale: int = 512) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if settle < 1:
            raise ValueError(f"settle must be >= 1, got {settle}")
        if clip < 1 or stale < 1:
            raise ValueError(f"clip must be >= 1 and stale >= 1, got {clip} and {stale}")
        self.alpha = alpha
        self.prior_slope = prior_slope
        self.settle = settle
        self.clip = clip
        self.stale = stale
        self._n: dict[tuple[int, int], int] = {}
        self._ms: dict[tuple[int, int], float] = {}
        self._seen: dict[tuple[int, int], int] = {}  # the forward count at each cell's latest forward
        self._totals: dict[tuple[int, int], tuple[float, int]] = {}  # every forward's ms, summed, and their count
        self._narrowest: dict[int, int] = {}  # per batch bucket, the narrowest measured width
        self._widest: dict[int, int] = {}
        self._priors: dict[tuple[int, int], float] = {}  # prior_ms per (bucket, width) at forward `_priors_at`
        self._ones: dict[int, float] = {}  # one_token_ms per bucket at forward `_priors_at`
        self._excess: dict[int, dict[int, tuple[float, int]]] = {}  # per bucket, at `_priors_at`: width -> (served/timed, n)
        self._priors_at = -1
        self._timed: dict[int, tuple[list[int], list[float]]] = {}  # per bucket: widths timed alone, their ms
        self.observed = 0
        self.last: tuple[int, int, float] | None = None  # (batch, width, ms) of the latest forward

    def observe(self, batch: int, width: int, ms: float) -> None:
        key = (batch_bucket(batch), width)
        if width < self._narrowest.get(key[0], width + 1):
            self._narrowest[key[0]] = width
        if width > self._widest.get(key[0], 0):
            self._widest[key[0]] = width
        n = self._fresh_n(key)
        old = self._ms.get(key) if n else None
        self._ms[key] = ms if old is None else old + self.alpha * (min(ms, self.clip * old) - old)
        self._n[key] = n + 1
        total, count = self._totals.get(key, (0.0, 0))
        self._totals[key] = (total + ms, count + 1)
        self.observed += 1
        self._seen[key] = self.observed
        self.last = (batch, width, ms)

    def forget(self, batch: int) -> None:
        """This batch bucket's cells restart at their next forward (its forward changed: a compiled
        graph took over from eager), the wider ones priced by the prior until then."""
        bucket = batch_bucket(batch)
        for key in self._seen:
            if key[0] == bucket:
                self._seen[key] = self.observed - self.stale
        self._priors_at = -1

    def calibrate(self, table: Mapping[int, Mapping[int, float]]) -> None:
        """What steps cost alone in the graphs that run them, {batch: {width: ms}} with a one-token
        step's (`DecodeGraphs.alone_costs`): each batch's bucket is priced by it from now on, and
        a bucket whose timings changed restarts (`forget`)."""
        timed = {}
        for batch, cells in table.items():
            if 1 in cells and len(cells) > 1:
                widths = sorted(cells)
                timed[batch_bucket(batch)] = (widths, [cells[w] for w in widths])
        for bucket in set(timed) | set(self._timed):
            if timed.get(bucket) != self._timed.get(bucket):
                self.forget(1 << bucket)
        self._timed = timed
        self._priors_at = -1

    def timed_ratio(self, batch: int, width: int) -> float | None:
        """A step of `width` against a one-token step as the graphs were timed alone (interpolated
        between timed widths, extrapolated past the widest), or None where nothing was timed. A
        batch whose graphs were not timed (the engine was stepping then) takes the nearest timed
        batch's ratios, the smaller first: far nearer its own than the prior slope."""
        timed = self._nearest_timed(batch_bucket(batch))
        if timed is None:
            return None
        widths, ms = timed
        i = min(max(bisect.bisect_left(widths, width), 1), len(widths) - 1)
        (w0, v0), (w1, v1) = (widths[i - 1], ms[i - 1]), (widths[i], ms[i])
        return max((v0 + (v1 - v0) * (width - w0) / (w1 - w0)) / ms[0], 1.0)

    def _nearest_timed(self, bucket: int) -> tuple[list[int], list[float]] | None:
        near = min(self._timed, key=lambda b: (abs(b - bucket), b > bucket), default=None)
        return None if near is None else self._timed[near]

    def _ratio_prior(self, batch: int, width: int) -> float:
        """A width's cost against a one-token step before it settles: timed, else `prior_ratio`."""
        timed = self.timed_ratio(batch, width)
        return self.prior_ratio(width) if timed is None else timed

    def _fresh_n(self, key: tuple[int, int]) -> int:
        """Forwards behind this cell's mean; 0 once it has not run for `stale` forwards."""
        return self._n.get(key, 0) if self.observed - self._seen.get(key, -self.stale) < self.stale else 0

    def samples(self, batch: int, width: int) -> int:
        """Forwards behind this cell's mean (0 once stale or forgotten)."""
        return self._fresh_n((batch_bucket(batch), width))

    def measured(self, batch: int, width: int) -> float | None:
        """This cell's running mean, if a forward of this batch bucket and width has run."""
        return self._ms.get((batch_bucket(batch), width))

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

    def _settled(self, bucket: int) -> list[tuple[int, float]]:
        """This bucket's fresh cells with at least `settle` forwards, narrowest first."""
        return sorted((w, v) for (b, w), v in list(self._ms.items())
                      if b == bucket and self._fresh_n((b, w)) >= self.settle)

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
        if self._priors_at != self.observed:
            self._priors.clear()
            self._ones.clear()
            self._excess.clear()
            self._priors_at = self.observed

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

    def table(self) -> dict[str, float]:
        """Measured cells as {"b<bucket>t<width>": ms}, for health pages and benchmarks."""
        cells = dict(self._ms)  # one copy: the engine thread may be adding cells
        return {f"b{1 << b}t{w}": round(v, 3) for (b, w), v in sorted(cells.items())}

    def totals(self) -> dict[str, tuple[float, int]]:
        """Every forward's ms per cell, unclipped, as {"b<bucket>t<width>": (sum, count)} over the
        engine's life: two reads' difference is the plain mean over the window between them (a
        benchmark level's), where `table`'s running mean weighs the last forwards most."""
        cells = dict(self._totals)
        return {f"b{1 << b}t{w}": (round(v, 3), n) for (b, w), (v, n) in sorted(cells.items())}

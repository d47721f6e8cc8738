"""What decode forwards cost on this machine: the running means the engine's forwards leave per
(batch bucket, tokens per row), and what the graphs cost alone."""
from __future__ import annotations

import bisect
from collections.abc import Mapping


def batch_bucket(batch: int) -> int:
    """Batch sizes are pooled by powers of two: 1, 2, 3-4, 5-8, ..."""
    return max(batch - 1, 0).bit_length()


class CostTable:
    """Running mean of decode-forward milliseconds per (batch bucket, tokens per row).

    The cost of widening a step is a property of the machine, the model and its dtype, and it
    drifts (other load, clocks), so it is measured on every step rather than read from a file. A
    forward counts at most `clip` times its cell's mean, and a cell not run in the last `stale`
    forwards counts as unmeasured again (`samples` 0): a width priced out under a burst of load
    is not priced out for good. A cell has settled after `settle` forwards. `calibrate` keeps what
    the compiled graphs cost alone. One cell per (bucket, width) the engine can run: the state is
    bounded by its limits. `version` changes with every change, for what is derived from it.
    """

    def __init__(self, alpha: float = 0.1, settle: int = 8, clip: float = 2.0, stale: int = 512) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if settle < 1:
            raise ValueError(f"settle must be >= 1, got {settle}")
        if clip < 1 or stale < 1:
            raise ValueError(f"clip must be >= 1 and stale >= 1, got {clip} and {stale}")
        self.alpha = alpha
        self.settle = settle
        self.clip = clip
        self.stale = stale
        self._n: dict[tuple[int, int], int] = {}
        self._ms: dict[tuple[int, int], float] = {}
        self._seen: dict[tuple[int, int], int] = {}  # the forward count at each cell's latest forward
        self._totals: dict[tuple[int, int], tuple[float, int]] = {}  # every forward's ms, summed, and their count
        self._narrowest: dict[int, int] = {}  # per batch bucket, the narrowest measured width
        self._widest: dict[int, int] = {}
        self._timed: dict[int, tuple[list[int], list[float]]] = {}  # per bucket: widths timed alone, their ms
        self.observed = 0
        self.version = 0
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
        self.version += 1

    def forget(self, batch: int) -> None:
        """This batch bucket's cells restart at their next forward (its forward changed: a compiled
        graph took over from eager), the wider ones priced by the prior until then."""
        bucket = batch_bucket(batch)
        for key in self._seen:
            if key[0] == bucket:
                self._seen[key] = self.observed - self.stale
        self.version += 1

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
        self.version += 1

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

    def _fresh_n(self, key: tuple[int, int]) -> int:
        """Forwards behind this cell's mean; 0 once it has not run for `stale` forwards."""
        return self._n.get(key, 0) if self.observed - self._seen.get(key, -self.stale) < self.stale else 0

    def samples(self, batch: int, width: int) -> int:
        """Forwards behind this cell's mean (0 once stale or forgotten)."""
        return self._fresh_n((batch_bucket(batch), width))

    def measured(self, batch: int, width: int) -> float | None:
        """This cell's running mean, if a forward of this batch bucket and width has run."""
        return self._ms.get((batch_bucket(batch), width))

    def _settled(self, bucket: int) -> list[tuple[int, float]]:
        """This bucket's fresh cells with at least `settle` forwards, narrowest first."""
        return sorted((w, v) for (b, w), v in list(self._ms.items())
                      if b == bucket and self._fresh_n((b, w)) >= self.settle)

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

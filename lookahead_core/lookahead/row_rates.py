"""How often candidate-tree rows are accepted, by source and depth: what one more row is expected to earn."""
from __future__ import annotations

import numpy as np

from lookahead_core.lookahead.tree import Source

# Prior acceptance of a row at depth 1 and its decay per level, by source: guesses that put every
# source within reach of a step's first rows so each gets measured; the counts take over quickly.
PRIOR = {Source.LOOKUP: (0.5, 0.85), Source.POOL: (0.2, 0.6), Source.SHARED: (0.15, 0.6),
         Source.SUCCESSORS: (0.3, 0.4), Source.HISTORY: (0.35, 0.8), Source.GRAMMAR: (0.9, 0.95)}


class RowRates:
    """Accepted / proposed tree rows per (source, depth), with `PRIOR` worth `pseudo` proposals.

    One per replica and one per request (`rates(pull=...)` pulls a request's own counts toward
    the replica's). A row's rate is the share of its proposals in which the model's own
    continuation ran through it, so a tree's expected accepted tokens are the sum of its rows'
    rates. Memory: two small float arrays, sized once.
    """

    def __init__(self, max_depth: int, pseudo: float = 4.0, prior: bool = True) -> None:
        self.max_depth = max(max_depth, 1)
        shape = (len(Source), self.max_depth)
        if prior:
            self.accepted = np.array([[first * decay**d for d in range(self.max_depth)]
                                      for first, decay in (PRIOR[s] for s in Source)]) * pseudo
            self.proposed = np.full(shape, pseudo)
        else:
            self.accepted, self.proposed = np.zeros(shape), np.zeros(shape)
        self._pseudo = pseudo if prior else 0.0
        self._prior = self.accepted.copy()

    def observe(self, sources: np.ndarray, depths: np.ndarray, accepted: np.ndarray) -> None:
        """Rows a step ran (their sources and depths) and which of them it accepted (a bool mask)."""
        d = np.minimum(depths, self.max_depth) - 1
        np.add.at(self.proposed, (sources, d), 1.0)
        np.add.at(self.accepted, (sources[accepted], d[accepted]), 1.0)

    def rates(self, own: RowRates | None = None, weight: float = 16.0) -> np.ndarray:
        """[source, depth - 1] acceptance; with `own` (a request's counts, no prior), those pulled
        toward these: after `weight` proposals of a cell the request's own rate counts half."""
        if own is None:
            return self.accepted / self.proposed
        return (own.accepted + weight * self.accepted / self.proposed) / (own.proposed + weight)

    def clear(self) -> None:
        self.accepted[:] = self._prior
        self.proposed.fill(self._pseudo)

    @property
    def nbytes(self) -> int:
        return self.accepted.nbytes + self.proposed.nbytes

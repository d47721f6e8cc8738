import numpy as np

from lookahead_core.lookahead.row_rates import PRIOR, RowRates
from lookahead_core.lookahead.tree import Source


def test_rates_start_at_the_prior_and_follow_what_was_accepted():
    rates = RowRates(4, pseudo=4.0)
    first, decay = PRIOR[Source.POOL]
    assert np.allclose(rates.rates()[Source.POOL], [first * decay**d for d in range(4)])
    # 12 pool rows at depth 1, 6 of them accepted; depth 9 counts as the deepest kept (4)
    src = np.full(13, Source.POOL)
    depth = np.array([1] * 12 + [9])
    hit = np.array([True] * 6 + [False] * 7)
    rates.observe(src, depth, hit)
    assert np.isclose(rates.rates()[Source.POOL, 0], (first * 4 + 6) / 16)
    assert np.isclose(rates.rates()[Source.POOL, 3], (first * decay**3 * 4) / 5)
    rates.clear()
    assert np.isclose(rates.rates()[Source.POOL, 0], first)


def test_a_requests_own_rates_are_pulled_toward_the_replicas():
    replica, own = RowRates(2), RowRates(2, prior=False)
    base = replica.rates()[Source.LOOKUP, 0]
    assert np.isclose(replica.rates(own, weight=16)[Source.LOOKUP, 0], base)  # nothing of its own yet
    own.observe(np.full(16, Source.LOOKUP), np.ones(16, dtype=np.int64), np.ones(16, dtype=bool))
    assert np.isclose(replica.rates(own, weight=16)[Source.LOOKUP, 0], (16 + 16 * base) / 32)  # half its own
    assert own.nbytes == 2 * len(Source) * 2 * 8

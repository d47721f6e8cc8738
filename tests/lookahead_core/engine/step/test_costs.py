"""CostTable: running means per (batch bucket, width), clipped, with unclipped totals."""
import pytest

from lookahead_core.engine.step.costs import CostTable, batch_bucket


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16)] == [0, 1, 2, 2, 3, 3, 4, 4]


def test_totals_sum_every_forward_unclipped_where_the_mean_is_clipped():
    costs = CostTable(alpha=0.5, clip=2.0)
    for ms in (10.0, 10.0, 100.0):  # one slow forward: the mean counts it as 20
        costs.observe(1, 1, ms)
    costs.observe(3, 2, 7.0)
    assert costs.table() == {"b1t1": 15.0, "b4t2": 7.0}
    assert costs.totals() == {"b1t1": (120.0, 3), "b4t2": (7.0, 1)}


def test_one_preempted_forward_moves_the_mean_by_at_most_clip():
    c = CostTable(alpha=0.1, settle=1, clip=2.0)
    c.observe(1, 1, 10.0)
    c.observe(1, 17, 30.0)
    c.observe(1, 17, 3000.0)  # descheduled mid-forward
    assert c.measured(1, 17) == 30.0 + 0.1 * (60.0 - 30.0)
    c.observe(1, 17, 15.0)  # faster samples are never clipped
    assert c.measured(1, 17) == 33.0 + 0.1 * (15.0 - 33.0)


def test_costs_refuse_a_clip_below_one():
    with pytest.raises(ValueError, match="clip"):
        CostTable(clip=0.5)

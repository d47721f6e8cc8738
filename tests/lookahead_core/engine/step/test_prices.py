"""StepCosts' prices: measured ratios, the priors for widths not settled, timed graphs, row price."""
import pytest

from lookahead_core.engine.step.prices import StepCosts


def test_prior_before_anything_is_measured():
    costs = StepCosts(prior_slope=0.1)
    assert costs.ratio(1, 1) == 1.0
    assert costs.ratio(1, 11) == costs.prior_ratio(11) == 2.0


def test_ratio_is_measured_per_batch_bucket():
    costs = StepCosts(alpha=1.0, settle=1)
    costs.observe(1, 1, 10.0)
    costs.observe(1, 9, 20.0)
    costs.observe(4, 1, 30.0)
    costs.observe(4, 9, 90.0)
    assert costs.ratio(1, 9) == 2.0
    assert costs.ratio(3, 9) == 3.0  # batch 3 shares the bucket of 4
    assert costs.table() == {"b1t1": 10.0, "b1t9": 20.0, "b4t1": 30.0, "b4t9": 90.0}


def test_an_unmeasured_width_costs_the_widest_narrower_one_plus_the_slope():
    costs = StepCosts(alpha=1.0, settle=1, prior_slope=0.05)
    costs.observe(1, 1, 10.0)
    assert costs.ratio(1, 4) == pytest.approx(1.0 + 3 * 0.05)  # nothing wide run: the prior slope
    costs.observe(1, 5, 15.0)
    one_cell = (15.0 - 10.0) / 4 / 10.0  # one wide width run: its rise from a one-token step
    assert costs.slope(0) == pytest.approx(one_cell)
    assert costs.ratio(1, 4) == pytest.approx(1.0 + 3 * one_cell)
    assert costs.ratio(1, 12) == pytest.approx(1.5 + 7 * one_cell)
    costs.observe(1, 12, 25.0)
    assert costs.ratio(1, 12) == 2.5
    assert costs.slope(0) == pytest.approx((25.0 - 15.0) / 7 / 10.0)  # two wide widths: the slope between
    assert costs.ratio(1, 16) == pytest.approx(2.5 + 4 * costs.slope(0))


def test_where_width_is_dear_the_first_wide_forwards_price_the_wider_ones():
    """Batch 16, a one-token step 50 ms, widths 4 and 6 tried once at 10 ms a token: width 17 is
    priced near its cost before anyone tries it (the prior slope would offer it at 1.8x)."""
    costs = StepCosts(prior_slope=0.05)
    costs.observe(16, 1, 50.0)
    costs.observe(16, 4, 80.0)
    costs.observe(16, 6, 100.0)
    assert costs.ratio(16, 17) > 3.5


def test_one_noisy_wide_cell_does_not_flatten_the_slope():
    """Widths 2-8 rise 10 ms a token, width 7 ran slow: the next width is still priced at the rise,
    not at width 8's cost (a zero slope would offer every wider width as free)."""
    costs = StepCosts(alpha=1.0, settle=1)
    costs.observe(16, 1, 50.0)
    for w in range(2, 9):
        costs.observe(16, w, 60.0 + 10.0 * (w - 2) + (15.0 if w == 7 else 0.0))
    assert 0.18 < costs.slope(4) < 0.25  # about 10 ms a token against a 50 ms one-token step
    assert costs.ms(16, 12) > costs.ms(16, 8) + 35.0


def test_the_estimate_follows_a_drifting_cost():
    costs = StepCosts(alpha=0.1, settle=1)
    for _ in range(50):
        costs.observe(1, 1, 10.0)
        costs.observe(1, 9, 12.0)
    assert abs(costs.ratio(1, 9) - 1.2) < 1e-6
    for _ in range(50):  # the machine gets busier: wide steps now cost twice a narrow one
        costs.observe(1, 1, 10.0)
        costs.observe(1, 9, 20.0)
    assert abs(costs.ratio(1, 9) - 2.0) < 0.05


def test_a_ratio_is_never_below_one():
    costs = StepCosts(alpha=1.0, settle=1)
    costs.observe(2, 1, 10.0)
    costs.observe(2, 3, 9.0)  # timing noise
    assert costs.ratio(2, 3) == 1.0


def test_row_price_is_the_mean_slope_up_to_the_widest_measured_step():
    c = StepCosts(alpha=1.0, settle=1)
    assert c.row_price(1) == 0.0  # nothing wide measured: every row is worth a try
    c.observe(1, 1, 40.0)
    c.observe(1, 17, 120.0)
    assert c.row_price(1) == (120.0 / 40.0 - 1.0) / 16
    assert c.row_price(4) == 0.0  # another batch bucket


def test_a_width_tried_only_a_few_times_is_priced_between_its_timings_and_the_prior():
    c = StepCosts(alpha=1.0, prior_slope=0.0, settle=4)
    c.observe(1, 1, 10.0)
    c.observe(1, 2, 20.0)  # one slow forward: not yet the price of width 2
    assert c.ratio(1, 2) == (20.0 + 3 * 10.0) / 4 / 10.0
    for _ in range(3):
        c.observe(1, 2, 20.0)
    assert c.ratio(1, 2) == 2.0  # tried four times: its own timing
    assert c.ratio(1, 1) == 1.0


def test_a_width_still_being_tried_is_priced_from_a_settled_narrower_one():
    c = StepCosts(alpha=1.0, prior_slope=0.05, settle=4)
    for _ in range(4):
        c.observe(16, 1, 10.0)
        c.observe(16, 3, 12.0)  # settled: 1 ms a token beyond a one-token step
    c.observe(16, 6, 30.0)  # tried once, slow: its own timing does not set its prior
    prior = 12.0 + 10.0 * (2.0 / 2 / 10.0) * 3  # width 3's cost, then width 3's slope per token beyond it
    assert c.ratio(16, 6) == pytest.approx((30.0 + 3 * prior) / 4 / 10.0)
    slope = (30.0 - 12.0) / 3 / 10.0  # widths 3 and 6
    assert c.ratio(16, 9) == pytest.approx((12.0 + 10.0 * slope * 6) / 10.0)  # never measured
    assert c.ratio(1, 6) == c.prior_ratio(6)  # another batch bucket knows nothing yet


def test_a_width_priced_out_under_load_is_tried_again_once_its_timing_is_stale():
    """A burst of load times the widest step at 10x; rows are then pruned, so that width would
    never run again and never be re-measured. After `stale` forwards it is priced by the prior
    again, and its next forward starts a fresh mean."""
    c = StepCosts(alpha=0.5, prior_slope=0.05, settle=2, stale=100)
    c.observe(1, 1, 10.0)
    for _ in range(4):
        c.observe(1, 17, 100.0)
    assert c.ratio(1, 17) > 5 and c.row_price(1) > 0.3
    for _ in range(99):  # plain steps only
        c.observe(1, 1, 10.0)
    assert c.ratio(1, 17) > 5  # still within `stale` forwards
    c.observe(1, 1, 10.0)
    assert c.ratio(1, 17) == c.prior_ratio(17) and c.row_price(1) == c.prior_slope
    c.observe(1, 17, 20.0)  # tried again, unloaded: the old mean is gone
    assert c.measured(1, 17) == 20.0
    c.observe(1, 17, 20.0)
    assert c.ratio(1, 17) == 2.0


def test_a_batch_whose_forward_changed_is_measured_afresh():
    """Eager timings of width 2 must not price the compiled width-2 graph that took over."""
    c = StepCosts(alpha=0.1, prior_slope=0.05, settle=2)
    for _ in range(20):
        c.observe(1, 1, 50.0)
        c.observe(1, 2, 100.0)  # eager
        c.observe(4, 1, 100.0)
        c.observe(4, 2, 200.0)
    assert c.ratio(1, 2) == 2.0
    c.forget(1)
    assert c.ratio(1, 2) == c.prior_ratio(2) and c.ratio(4, 2) == 2.0  # another batch bucket keeps its timings
    c.observe(1, 1, 25.0)  # compiled
    c.observe(1, 2, 30.0)
    assert c.measured(1, 1) == 25.0 and c.measured(1, 2) == 30.0
    assert c.samples(1, 2) == 1 and c.samples(4, 2) == 20


def test_a_one_token_step_is_priced_no_dearer_than_a_settled_wider_one():
    """A one-token cell whose first timing erred slow (a graph's first call), then seldom re-run
    because wider steps are taken: it would price every width as free. It is priced at most at the
    cheapest settled wider width, so wider ones still cost what they cost beyond it."""
    c = StepCosts(alpha=0.1, settle=4)
    c.observe(1, 1, 60.0)
    c.observe(1, 1, 20.0)
    for _ in range(4):
        c.observe(1, 3, 22.0)
        c.observe(1, 9, 38.0)
    assert c.measured(1, 1) > 50.0
    assert c.one_token_ms(1) == 22.0
    assert c.ratio(1, 3) == 1.0 and c.ratio(1, 9) == pytest.approx(38.0 / 22.0)
    c.observe(1, 2, 21.0)  # tried once: not settled, so it does not set the price
    assert c.one_token_ms(1) == 22.0


def test_widths_not_run_are_priced_as_their_graphs_were_timed_alone():
    """A one-token step 20 ms alone and the wide graph 40 ms at width 2 and 60 ms at width 6 (a
    jump from one token to two that no slope from one token shows): before any forward, and after
    one-token forwards only, each width is priced at its timed ratio, interpolated between timed
    widths and extrapolated past the widest."""
    c = StepCosts(alpha=1.0, prior_slope=0.05)
    c.calibrate({4: {1: 20.0, 2: 40.0, 6: 60.0}})
    assert c.ratio(4, 2) == 2.0 and c.ratio(3, 4) == 2.5 and c.ratio(4, 10) == 4.0  # 3-4 share a bucket
    assert c.ratio(8, 2) == 2.0 and c.ratio(1, 6) == 3.0  # batches not timed: the nearest timed one's ratios
    assert c.one_token_ms(8) is None  # but not its cost
    assert c.one_token_ms(4) == 20.0 and c.estimate_ms(4, 6) == 60.0
    assert c.row_price(4) == pytest.approx((3.0 - 1.0) / 5)  # to the widest timed
    c.observe(4, 1, 30.0)  # under load: every width is priced at its ratio to what a one-token step costs now
    assert c.ms(4, 2) == 60.0 and c.ratio(4, 6) == 3.0


def test_a_width_run_settles_on_its_own_timings_and_reverts_to_the_timed_price_when_stale():
    c = StepCosts(alpha=1.0, settle=2, stale=10)
    c.calibrate({1: {1: 10.0, 4: 30.0}})
    c.observe(1, 1, 10.0)
    c.observe(1, 4, 20.0)
    assert c.ratio(1, 4) == 2.5  # one timing: halfway to the timed price
    c.observe(1, 4, 20.0)
    assert c.ratio(1, 4) == 2.0  # settled
    for _ in range(10):
        c.observe(1, 1, 10.0)
    assert c.ratio(1, 4) == 3.0  # stale: the timed price, not the prior slope's 1.15


def test_wide_widths_not_run_take_the_served_excess_of_those_run():
    """Alone, widths 2, 4 and 6 cost 1.2x, 1.4x and 1.6x a one-token step; served, width 2 settles
    at three times its timed price: widths not yet run are priced at three times theirs too (not
    tried one by one at the price alone), and a width run and settled keeps its own."""
    c = StepCosts(alpha=1.0, settle=2, stale=100)
    c.calibrate({16: {1: 40.0, 2: 48.0, 4: 56.0, 6: 64.0}})
    c.observe(16, 1, 50.0)
    assert c.ratio(16, 4) == pytest.approx(1.4)  # nothing wide run yet: the timed ratio
    c.observe(16, 2, 180.0)
    c.observe(16, 2, 180.0)
    assert c.served_factor(4) == pytest.approx(180.0 / (50.0 * 1.2))
    assert c.ratio(16, 4) == pytest.approx(1.4 * 3.0) and c.ratio(16, 6) == pytest.approx(1.6 * 3.0)
    assert c.ratio(16, 2) == pytest.approx(3.6)  # its own timings
    assert c.ratio(1, 4) == pytest.approx(1.4)  # another bucket's excess is its own
    for _ in range(100):  # width 2 stale: widths are tried at their timed price again
        c.observe(16, 1, 50.0)
    assert c.served_factor(4) == 1.0 and c.ratio(16, 4) == pytest.approx(1.4)
    c.observe(16, 2, 30.0)  # served below its timed price: a brake only, never a spur
    assert c.served_factor(4) == 1.0 and c.ratio(16, 4) == pytest.approx(1.4)


def test_new_timings_restart_their_bucket_only():
    c = StepCosts(alpha=1.0, settle=1)
    c.calibrate({1: {1: 10.0, 2: 20.0}, 4: {1: 20.0, 2: 30.0}})
    for batch in (1, 4):
        c.observe(batch, 1, 10.0)
        c.observe(batch, 2, 25.0)
    c.calibrate({1: {1: 10.0, 2: 20.0}, 4: {1: 20.0, 2: 60.0}})
    assert c.ratio(1, 2) == 2.5 and c.ratio(4, 2) == 3.0  # batch 1 keeps its own; batch 4 restarts at its new price
    assert c.samples(1, 2) == 1 and c.samples(4, 2) == 0
    c.calibrate({})  # the graphs dropped: the prior again
    assert c.samples(1, 2) == 0 and c.ratio(4, 2) == c.prior_ratio(2)

"""StepPlanner: the SLO caps a step by what every row's user waits, plain rows included."""
from lookahead_core.engine.planner import StepPlanner
from lookahead_core.engine.sequence import Offer
from lookahead_core.engine.step_costs import StepCosts
from lookahead_core.lookahead.pacing import StepKind, StepPacer


def _copied_run_offer(tokens: float) -> Offer:
    """A paced row whose likeliest candidate is a long copied run, expected to yield `tokens`."""
    pacer = StepPacer()
    verify = [(rows, min(1.0 + rows, tokens)) for rows in range(1, 33)]
    return Offer(1, pacer.menu(40, verify, True), pacer, True)


def test_one_row_with_a_long_copied_run_does_not_widen_a_batch_past_the_slo():
    """15 plain rows and one expecting 20 tokens from a 33-row step: the step would cost the plain
    rows' users its whole time per token, so at a one-token step of 216 ms and an SLO of 50 ms
    nothing widens; alone, the same row widens."""
    costs = StepCosts()
    costs.observe(16, 1, 216.0)
    costs.observe(1, 1, 30.0)
    planner = StepPlanner(costs, max_batch=16, slo_tpot_ms=50.0)
    choices = planner.plan([_copied_run_offer(20.0)] + [Offer(1)] * 15)
    assert [c.kind for c in choices] == [StepKind.PLAIN] * 16
    (alone,) = planner.plan([_copied_run_offer(20.0)])
    assert alone.kind is not StepKind.PLAIN


def test_the_slo_prices_a_width_never_run_at_least_by_the_prior():
    costs = StepCosts(prior_slope=0.05, settle=1)
    assert costs.estimate_ms(4, 8) is None  # nothing ran yet: nothing to price by
    costs.observe(1, 1, 30.0)
    # batch 4 never ran: at least one sequence's one-token step, widened by the prior
    assert costs.estimate_ms(4, 1) == 30.0 and costs.estimate_ms(4, 21) == 30.0 * 2.0
    costs.observe(4, 1, 60.0)
    assert costs.estimate_ms(4, 21) == 60.0 * 2.0  # unmeasured width: not the narrower cell's 60 ms
    costs.observe(4, 21, 600.0)
    assert costs.estimate_ms(4, 21) == 600.0

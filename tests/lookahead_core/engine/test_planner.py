"""StepPlanner: the row price, each draft's menu, the SLO's cap on what every row's user waits."""
import numpy as np

from lookahead_core.engine.planner import StepPlanner
from lookahead_core.engine.step_costs import StepCosts
from lookahead_core.lookahead.drafter import Draft
from lookahead_core.lookahead.pacing import StepKind, StepPacer
from lookahead_core.lookahead.tree import CandidateTree


def _draft(odds, pacer: StepPacer | None, copied=True, full_start=8, full_tokens=2.0) -> Draft:
    odds = np.asarray(odds, dtype=float)
    return Draft(CandidateTree(len(odds)), np.arange(len(odds)), odds, copied, full_start, full_tokens, pacer)


def _copied_run_offer(tokens: int) -> Draft:
    """A paced row whose likeliest candidate is a long copied run: 32 tree rows after a window of 7
    (a whole step 40 wide), the first `tokens` - 1 of them sure to be accepted."""
    return _draft([1.0] * (tokens - 1) + [0.0] * (33 - tokens), StepPacer())


def test_one_row_with_a_long_copied_run_does_not_widen_a_batch_past_the_slo():
    """15 plain rows and one expecting 20 tokens from a 33-row step: the step would cost the plain
    rows' users its whole time per token, so at a one-token step of 216 ms and an SLO of 50 ms
    nothing widens; alone, the same row widens."""
    costs = StepCosts()
    costs.observe(16, 1, 216.0)
    costs.observe(1, 1, 30.0)
    planner = StepPlanner(costs, max_batch=16, slo_tpot_ms=50.0)
    choices = planner.plan([_copied_run_offer(20)] + [None] * 15, row_price=0.0)
    assert [c.kind for c in choices] == [StepKind.PLAIN] * 16
    (alone,) = planner.plan([_copied_run_offer(20)], row_price=0.0)
    assert alone.kind is not StepKind.PLAIN


def test_a_whole_step_keeps_the_tree_rows_that_earn_their_price():
    """A fixed (N, W, G) runs whole: the planner keeps the rows accepted at least as often as a
    row costs, and the width follows."""
    planner = StepPlanner(StepCosts(), max_batch=4)
    odds = [0.9, 0.5, 0.2, 0.05]
    for price, rows in ((0.0, 4), (0.1, 3), (0.6, 1), (1.0, 0)):
        (choice,) = planner.plan([_draft(odds, pacer=None)], row_price=price)
        assert choice.kind is StepKind.FULL and choice.rows == rows


def test_a_pinned_row_price_holds_whatever_the_costs_say():
    costs = StepCosts()
    costs.observe(1, 1, 10.0)
    costs.observe(1, 17, 100.0)
    assert StepPlanner(costs, max_batch=1).row_price(1) > 0.1
    assert StepPlanner(costs, max_batch=1, row_price=0.0).row_price(1) == 0.0


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

"""StepPlanner: the row price, each draft's menu, the SLO's cap on what every row's user waits."""
import numpy as np
import pytest

from lookahead_core.engine.step.planner import StepPlanner
from lookahead_core.engine.step.prices import Prices, StepCosts
from lookahead_core.lookahead.drafter import Draft
from lookahead_core.lookahead.pacing import StepKind, StepPacer
from lookahead_core.lookahead.tree import CandidateTree


def _draft(odds, pacer: StepPacer | None, copied=True, full_start=8, full_tokens=2.0) -> Draft:
    odds = np.asarray(odds, dtype=float)
    return Draft(CandidateTree(len(odds)), np.arange(len(odds)), odds, copied, full_start, full_tokens, pacer)


def _plan(planner: StepPlanner, costs: StepCosts, drafts, row_price=0.0):
    """A plan at the prices of the batch the drafts fill."""
    return planner.plan(drafts, row_price, costs.prices(planner.batch(len(drafts))))


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
    planner = StepPlanner(max_batch=16, slo_tpot_ms=50.0)
    choices = _plan(planner, costs, [_copied_run_offer(20)] + [None] * 15)
    assert [c.kind for c in choices] == [StepKind.PLAIN] * 16
    (alone,) = _plan(planner, costs, [_copied_run_offer(20)])
    assert alone.kind is not StepKind.PLAIN


def test_a_whole_step_keeps_the_tree_rows_that_earn_their_price():
    """A fixed (N, W, G) runs whole: the planner keeps the rows accepted at least as often as a
    row costs, and the width follows."""
    planner = StepPlanner(max_batch=4)
    prices = Prices(1, 0.05, lambda width: 1.0 + 0.05 * (width - 1), lambda width: None)  # pinned, no SLO
    odds = [0.9, 0.5, 0.2, 0.05]
    for price, rows in ((0.0, 4), (0.1, 3), (0.6, 1), (1.0, 0)):
        (choice,) = planner.plan([_draft(odds, pacer=None)], price, prices)
        assert choice.kind is StepKind.FULL and choice.rows == rows


def test_a_pinned_row_price_holds_whatever_the_costs_say():
    costs = StepCosts()
    costs.observe(1, 1, 10.0)
    costs.observe(1, 17, 100.0)
    assert StepPlanner(max_batch=1).row_price(costs.prices(1)) > 0.1
    assert StepPlanner(max_batch=1, row_price=0.0).row_price(costs.prices(1)) == 0.0


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


def test_rows_that_do_not_pace_pay_a_wider_step_too():
    """One paced row sure of 3 tokens from a step twice the cost of a one-token one: worth it
    alone, not with 15 plain rows yielding one token each at that cost."""
    costs = StepCosts(settle=1)
    for batch in (1, 16):
        costs.observe(batch, 1, 50.0)
        costs.observe(batch, 2, 100.0)
        costs.observe(batch, 3, 100.0)
    planner = StepPlanner(max_batch=16)
    sure = _draft([1.0, 1.0, 0.0], StepPacer(), full_start=9)
    assert _plan(planner, costs, [sure])[0].kind is StepKind.VERIFY
    assert [c.kind for c in _plan(planner, costs, [sure] + [None] * 15)] == [StepKind.PLAIN] * 16


def test_drafting_pauses_while_plans_keep_every_row_plain():
    """Where width does not pay, the batch drafts on steps 1, 3, 6, 11, ... (pauses of 1, 2, 4,
    ... steps, at most `max_pause`); a plan that widens ends the pause; other batch sizes keep
    drafting, and a request alone always drafts."""
    costs = StepCosts(alpha=1.0, settle=1)
    for width, ms in ((1, 50.0), (2, 100.0), (3, 150.0)):
        costs.observe(16, width, ms)
    planner = StepPlanner(max_batch=16, max_pause=4)
    doubtful = [_draft([0.3, 0.2], StepPacer(), full_start=9)] * 16
    drafted = []
    for step in range(20):
        due = planner.drafts_due(16)
        if due:
            assert all(c.kind is StepKind.PLAIN for c in _plan(planner, costs, doubtful))
            drafted.append(step)
    assert drafted == [0, 2, 5, 10, 15]
    assert planner.drafts_due(4)
    costs.observe(1, 1, 50.0)
    costs.observe(1, 2, 100.0)
    for _ in range(3):
        assert planner.drafts_due(1)
        _plan(planner, costs, doubtful[:1])
    costs.observe(16, 2, 50.0)  # width got cheap: the next plan widens, and drafting resumes
    while not planner.drafts_due(16):
        pass
    assert _plan(planner, costs, doubtful)[0].kind is not StepKind.PLAIN
    assert planner.drafts_due(16)


def test_the_planner_learns_how_far_wide_steps_fall_short_of_their_estimate():
    """16 rows, each expecting 1.5 tokens from a step 1.4x a one-token one: worth it (24 / 1.4 >
    16) until wide steps keep yielding half the extra tokens expected (20 / 1.4 < 16)."""
    costs = StepCosts(alpha=1.0, settle=1)
    costs.observe(16, 1, 50.0)
    costs.observe(16, 2, 70.0)
    planner = StepPlanner(max_batch=16)
    rows = [_draft([0.5], StepPacer(), full_start=9)] * 16
    assert all(c.kind is StepKind.VERIFY for c in _plan(planner, costs, rows))
    for _ in range(10):
        _plan(planner, costs, rows)
        planner.learn([2 if b % 4 == 0 else 1 for b in range(16)])  # 4 extra tokens where 8 were expected
    assert planner.bias.factor == pytest.approx(0.5)
    assert all(c.kind is StepKind.PLAIN for c in _plan(planner, costs, rows))
    planner.learn([1] * 16)  # a plain step teaches nothing
    assert planner.bias.factor == pytest.approx(0.5)


def test_a_batch_whose_graphs_were_timed_keeps_its_rows_plain_where_width_is_dear():
    """4 rows each expecting 1.7 tokens from one candidate row, and one-token steps measured only:
    by the prior slope a two-token step costs 1.05x one, so every row verifies; where the wide
    graph was timed alone at 1.7x a one-token step (the jump from the one-token graph), the same
    plan keeps them plain, and a row sure of its copied run still widens the step."""
    rows = [_draft([0.7], StepPacer(), full_start=9)] * 4
    untimed = StepCosts()
    untimed.observe(4, 1, 25.0)
    assert all(c.kind is StepKind.VERIFY for c in _plan(StepPlanner(max_batch=4), untimed, rows))
    timed = StepCosts()
    timed.calibrate({4: {1: 24.0, 2: 41.0, 4: 55.0, 8: 90.0}})
    timed.observe(4, 1, 25.0)
    planner = StepPlanner(max_batch=4)
    assert all(c.kind is StepKind.PLAIN for c in _plan(planner, timed, rows))
    sure = _draft([1.0, 1.0, 1.0], StepPacer(), full_start=9)  # 4 tokens from a step of 4
    assert _plan(planner, timed, [sure] + rows[:3])[0].kind is StepKind.VERIFY


def _width(choice, full_width: int) -> int:
    return {StepKind.PLAIN: 1, StepKind.FULL: full_width}.get(choice.kind, 1 + (choice.rows or 0))


def test_a_fixed_rows_own_yield_does_not_pay_for_a_plain_rows_wait():
    """A fixed (N, W, G) expecting 6 tokens from its 12-wide step (120 ms) beside a plain row: the
    batch's mean (3.5 tokens a row) would fit a 50 ms SLO, but the plain row's user would wait
    120 ms for its token. The plan's step keeps every row that yields one token within the SLO;
    alone, the fixed row runs whole."""
    slo = 50.0
    prices = Prices(2, 0.0, lambda width: 1.0 + 0.05 * (width - 1), lambda width: 10.0 * width)
    planner = StepPlanner(max_batch=2, slo_tpot_ms=slo)
    fixed = _draft([1.0] * 4, pacer=None, full_tokens=6.0)  # 8 + 4 rows wide
    choices = planner.plan([fixed, None], 0.0, prices)
    width = max(_width(c, 12) for c in choices)
    assert prices.estimate_ms(width) <= slo
    assert choices[0].kind is StepKind.VERIFY and choices[1].kind is StepKind.PLAIN  # narrowed, not dropped
    (alone,) = planner.plan([fixed], 0.0, prices)
    assert alone.kind is StepKind.FULL and alone.rows == 4

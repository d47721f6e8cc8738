from functools import partial

import pytest

from lookahead_core.engine.step.planner import batch_width, pick, step_menu
from lookahead_core.lookahead.pacing import FullYields, Option, StepKind, StepPacer, YieldBias

P, V, F = StepKind.PLAIN, StepKind.VERIFY, StepKind.FULL
FULL_WIDTH = 9


def choose(pacer, full_width, verify, copied, ratio):
    """The pacer's pick as the only row of a step, as the planner makes it for a request alone."""
    menu = step_menu(full_width, verify, pacer.yields[copied])
    return pick(pacer, menu, copied, batch_width([menu], ratio), ratio, widen=True)


def _run(pacer, steps, tokens_of, ratio_of, copied=False, verify=()):
    kinds = []
    for _ in range(steps):
        choice = choose(pacer, FULL_WIDTH, verify, copied, ratio_of)
        kinds.append(choice.kind)
        pacer.update(choice, tokens_of(choice.kind))
    return kinds


def test_cheap_wide_steps_that_pay_stay_full():
    kinds = _run(StepPacer(), 100, lambda k: 3 if k is F else 1, lambda w: 1.0 + 0.02 * (w - 1))
    assert kinds[10:].count(F) >= 85


def test_wide_steps_that_do_not_pay_turn_plain_with_rarer_probes():
    kinds = _run(StepPacer(), 400, lambda k: 1, lambda w: 2.0 if w > 1 else 1.0)
    assert kinds[-300:].count(P) >= 290
    late_probes = [i for i, k in enumerate(kinds) if k is not P and i >= 200]
    assert len(late_probes) <= 200 // 64 + 2  # the window tried about once every max_interval steps


def test_a_request_whose_text_starts_paying_widens_again():
    pacer = StepPacer()
    _run(pacer, 200, lambda k: 1, lambda w: 1.5 if w > 1 else 1.0)
    kinds = _run(pacer, 300, lambda k: 4 if k is F else 1, lambda w: 1.5 if w > 1 else 1.0)
    assert kinds[-100:].count(F) >= 90


def test_copied_runs_are_judged_apart_from_pooled_ngrams():
    pacer = StepPacer()

    def ratio(w):
        return 1.6 if w > 1 else 1.0

    for step in range(300):
        copied = step % 2 == 0
        choice = choose(pacer, FULL_WIDTH, (), copied, ratio)
        pacer.update(choice, 4 if copied and choice.kind is F else 1)
    assert choose(pacer, FULL_WIDTH, (), True, ratio).kind is F
    assert choose(pacer, FULL_WIDTH, (), False, ratio).kind is P


def test_verify_keeps_the_rows_whose_expected_tokens_pay_for_their_width():
    """Each VERIFY option is (rows, expected tokens); the width that buys the most per cost wins."""
    verify = [(1, 1.30), (2, 1.45), (3, 1.50)]
    pacer = StepPacer(prior=1.0)  # a window that has not paid
    pacer.idle = -1000  # no retry due

    def sloped(w):  # each row 10% of a one-token step
        return 1.0 + 0.1 * (w - 1)

    choice = choose(pacer, FULL_WIDTH, verify, False, sloped)
    assert (choice.kind, choice.rows) == (V, 2)  # 1.45 / 1.2 beats 1.3 / 1.1 and 1.5 / 1.3
    assert choose(pacer, FULL_WIDTH, verify, False, lambda w: 2.0 if w > 1 else 1.0).kind is P
    assert choose(pacer, FULL_WIDTH, verify, False, lambda w: 1.0).rows == 3  # free width: every row
    pacer.update(choice, 5)  # a VERIFY step's yield teaches the window nothing
    assert pacer.yields == {False: 1.0, True: 1.0}


def test_only_the_kinds_on_offer_are_chosen():
    pacer = StepPacer()
    for _ in range(50):
        choice = choose(pacer, 5, (), False, lambda w: 1.0)
        assert choice.kind in (F, P)
        pacer.update(choice, 1)
    assert choose(pacer, None, [(2, 1.5)], False, lambda w: 1.0).kind is V


def test_the_batch_width_pays_for_the_tokens_of_every_row():
    def flat(w):  # memory-bound: width nearly free
        return 1.0 + 0.01 * (w - 1)

    def steep(w):  # every wide step costs two
        return 1.0 if w == 1 else 2.0

    def menu(*options):
        return [Option(P, 1, 1.0), *(Option(k, w, t) for k, w, t in options)]

    one_keen = [menu((F, 9, 3.0))] + [menu((F, 9, 1.1))] * 15
    # Alone, a request at 3 tokens for 2x pays; in a batch of 16 it would slow 15 others.
    assert batch_width(one_keen[:1], steep) == 9
    assert batch_width(one_keen, steep) == 1
    assert batch_width(one_keen, flat) == 9
    all_keen = [menu((V, 5, 3.0), (F, 9, 3.0))] * 16
    assert batch_width(all_keen, steep) == 5  # the same cost, fewer rows: the narrower on a tie
    assert batch_width([menu((F, 9, 3.0))], steep, floor=12) == 12  # a row that does not pace sets the floor
    # Rows that do not pace (plain ones) pay the wider step too: 3 tokens for 2x pays one keen
    # row alone, not when 15 others yield one token each at twice the cost.
    assert batch_width(one_keen[:1], steep, rest=15.0) == 1


def test_the_tpot_slo_caps_the_width():
    menus = [[Option(P, 1, 1.0), Option(F, 9, 1.5)]] * 4

    def flat(w):
        return 1.0 + 0.01 * (w - 1)

    assert batch_width(menus, flat) == 9

    # 10 ms per one-token step, 20 ms at width 9: 13.3 ms per token there; an SLO of 12 ms rules it out
    def ms(w):
        return 10.0 if w == 1 else 20.0

    assert batch_width(menus, flat, fits_slo=lambda w, tokens: ms(w) / tokens <= 12.0) == 1
    assert batch_width(menus, flat, fits_slo=lambda w, tokens: ms(w) / tokens <= 14.0) == 9


def test_a_row_takes_its_best_kind_within_the_batch_width_and_retries_only_when_it_fits():
    pacer = StepPacer()
    for _ in range(20):
        menu = step_menu(FULL_WIDTH, [(4, 1.2)], pacer.yields[False])
        choice = pick(pacer, menu, False, 1, lambda w: 2.0 if w > 1 else 1.0)
        assert choice.kind is P  # a retry is due, but a wider step would cost the batch
        pacer.update(choice, 1)
    menu = step_menu(FULL_WIDTH, [(4, 1.2)], pacer.yields[False])
    assert pick(pacer, menu, False, 9, lambda w: 1.0).kind is F  # width already paid for


def test_a_new_request_starts_from_what_whole_steps_yielded_across_the_replica():
    """Sampled requests whose windows never paid: the next one does not widen its first steps to
    find out again (a fresh guess of 2.0 tokens would), and greedy requests keep their own figure."""
    replica = FullYields()

    def ratio(w):
        return 1.5 if w > 1 else 1.0

    for _ in range(10):  # earlier sampled requests, each running whole steps that yield 1 token
        pacer = StepPacer(replica.start(True), on_full=partial(replica.observe, True))
        _run(pacer, 40, lambda k: 1, ratio)
    assert replica.means[(True, False)] < 1.2 and replica.means[(False, False)] == 2.0
    fresh = _run(StepPacer(), 3, lambda k: 1, ratio)
    informed = _run(StepPacer(replica.start(True)), 3, lambda k: 1, ratio)
    assert fresh[0] is F and informed == [P, P, P]
    assert _run(StepPacer(replica.start(False)), 1, lambda k: 1, ratio) == [F]  # greedy: still the prior


def test_the_replica_figure_is_a_plain_mean_until_it_has_seen_enough_steps():
    """A fresh replica learns from its first whole steps (the prior counts as one), then moves as
    a moving average."""
    replica = FullYields(prior=2.0, alpha=0.25)
    replica.observe(True, False, 1)
    assert replica.means[(True, False)] == 1.5
    replica.observe(True, False, 1)
    assert replica.means[(True, False)] == pytest.approx(4 / 3)
    replica.observe(True, False, 1)
    assert replica.means[(True, False)] == pytest.approx(1.25)  # (2 + 3) / 4: 1 / alpha steps
    replica.observe(True, False, 5)
    assert replica.means[(True, False)] == pytest.approx(1.25 + 0.25 * 3.75)  # a moving average from here
    assert replica.means[(False, False)] == 2.0
    replica.clear()
    assert replica.means[(True, False)] == 2.0 and replica.counts[(True, False)] == 0



def test_the_yield_bias_is_a_bounded_ratio_of_decaying_sums():
    bias = YieldBias(decay=0.5, low=0.5, high=1.25, min_expected=4.0)
    bias.observe(2.0, 0.0)
    assert bias.factor == 1.0  # too little expected yet to judge by
    bias.observe(4.0, 3.0)  # sums: 5 expected (2 halved, 4), 3 realized
    assert bias.factor == pytest.approx(0.6)
    bias.observe(8.0, 0.0)
    assert bias.factor == 0.5  # 1.5 of 10.5: held at the lower bound
    for _ in range(20):
        bias.observe(4.0, 8.0)
    assert bias.factor == 1.25  # under-estimates count too, within the bound
    bias.clear()
    assert (bias.factor, bias.expected, bias.realized) == (1.0, 0.0, 0.0)

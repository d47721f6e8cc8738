import pytest

from lookahead_core.lookahead.window import LookaheadWindow


def test_initial_columns_are_runs_of_the_seed():
    win = LookaheadWindow(n=3, w=4, seed_tokens=[9, 1, 2, 3, 4, 5])
    # span w + n - 2 = 5 tail tokens: 1..5; level l holds seed[j + l]
    assert win.levels == [[1, 2, 3, 4], [2, 3, 4, 5]]
    assert win.flat() == [1, 2, 3, 4, 2, 3, 4, 5]


def test_short_seed_is_repeated():
    win = LookaheadWindow(n=4, w=3, seed_tokens=[7])
    assert win.levels == [[7, 7, 7]] * 3


def test_update_harvests_columns_and_shifts_levels():
    win = LookaheadWindow(n=3, w=2, seed_tokens=[1, 2, 3])
    assert win.levels == [[1, 2], [2, 3]]
    ngrams = win.update([8, 9])
    assert ngrams == [(1, 2, 8), (2, 3, 9)]
    assert win.levels == [[2, 3], [8, 9]]


def test_bigram_window():
    win = LookaheadWindow(n=2, w=3, seed_tokens=[4, 5, 6])
    assert win.update([7, 8, 9]) == [(4, 7), (5, 8), (6, 9)]
    assert win.levels == [[7, 8, 9]]


def test_wrong_output_count_and_empty_seed():
    win = LookaheadWindow(n=3, w=2, seed_tokens=[1])
    with pytest.raises(ValueError):
        win.update([1])
    with pytest.raises(ValueError):
        LookaheadWindow(n=3, w=2, seed_tokens=[])

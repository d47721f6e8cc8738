import random

from lookahead_core.lookahead.history import SharedHistory


def test_the_longest_match_proposes_as_much_as_it_matched():
    h = SharedHistory(64, matches=(4, 2))
    h.add_text([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert h.propose([7, 7, 3, 4], 16) == (5, 6)  # a 2-token match: 2 tokens
    assert h.propose([1, 2, 3, 4], 16) == (5, 6, 7, 8)  # a 4-token match: 4 tokens
    assert h.propose([2, 3, 4, 5, 6, 7], 3) == (8, 9)  # cut at the end of that text
    assert h.propose([1, 2, 3, 4], 3) == (5, 6, 7) and h.propose([9, 9], 8) == () and h.propose([3], 8) == ()


def test_no_continuation_crosses_from_one_text_into_the_next():
    h = SharedHistory(64, matches=(2,))
    h.add_text([1, 2, 3])
    h.add_text([4, 5])
    assert h.propose([1, 2], 8) == (3,) and h.propose([2, 3], 8) == ()
    h.add_text([1, 2, 6, 7])
    assert h.propose([1, 2], 8) == (6, 7)  # the latest continuation wins


def test_memory_is_bounded_and_evicted_text_proposes_nothing():
    h = SharedHistory(32, matches=(3, 2))
    rng = random.Random(0)
    h.add_text([100, 101, 102, 103])
    for _ in range(50):
        h.add_text([rng.randrange(50) for _ in range(rng.randrange(1, 12))])
    assert h.propose([100, 101, 102], 8) == ()
    assert len(h) <= 32 * 2 and h.nbytes == 32 * 8
    # every entry left points at a continuation still in the ring, under its own key
    for key, start in h._index.items():
        assert h._key(start - len(key), len(key)) == key and h._token(start) >= 0
    h.clear()
    assert len(h) == 0 and h.propose([1, 2], 4) == ()

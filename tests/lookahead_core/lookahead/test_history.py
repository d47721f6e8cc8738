import copy
import random

import numpy as np
import pytest

from lookahead_core.lookahead.history import SharedHistory, SuffixIndex

GAP = -1


class Reference:
    """The history as plainly as it can be written: every token ever written, and a dict built
    afresh from the ring's window at each lookup, the latest continuation of each m-gram winning."""

    def __init__(self, capacity, matches, max_extend):
        self.capacity, self.matches, self.max_extend = capacity, sorted(set(matches), reverse=True), max_extend
        self.tape: list[int] = []

    def add_text(self, tokens):
        self.tape += list(tokens[-(self.capacity - 1):]) + [GAP]

    def live(self):
        return max(0, len(self.tape) - self.capacity)

    def index(self, m):
        out = {}
        for p in range(self.live() + m, len(self.tape)):
            key = tuple(self.tape[p - m : p])
            if GAP not in key and self.tape[p] != GAP:
                out[key] = p
        return out

    def __len__(self):
        return sum(len(self.index(m)) for m in self.matches)

    def propose(self, tokens, max_len):
        if max_len <= 0:
            return ()
        for m in self.matches:
            start = self.index(m).get(tuple(tokens[-m:])) if len(tokens) >= m else None
            if start is None:
                continue
            matched = m
            while (matched < self.max_extend and matched < len(tokens) and start - matched - 1 >= self.live()
                   and self.tape[start - matched - 1] == tokens[-matched - 1] != GAP):
                matched += 1
            out = self.tape[start : start + min(max_len, max(2, matched))]
            return tuple(out[: out.index(GAP)] if GAP in out else out)
        return ()

    def followed(self, tokens, out):
        """Whether `out` followed, somewhere in the ring, one of the suffix's `matches` lengths."""
        return any(self.tape[p - m : p] == list(tokens[-m:]) and self.tape[p : p + len(out)] == list(out)
                   for m in self.matches if len(tokens) >= m
                   for p in range(self.live() + m, len(self.tape)))


def random_run(seed, capacity, texts=300):
    """Random texts over a small vocabulary, wrapping the ring many times, each followed by
    queries: random ones and prefixes of recent text (so that many of them match)."""
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 4])
    recent: list[int] = []
    for _ in range(texts):
        text = [rng.randrange(vocab) for _ in range(rng.randrange(0, 2 * capacity))]
        recent = (recent + text)[-3 * capacity :]
        queries = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 12))] for _ in range(3)]
        queries += [recent[: rng.randrange(len(recent) + 1)] for _ in range(3)]
        yield text, [(q, rng.randrange(-1, 12)) for q in queries]


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
    arrays = {k: v for k, v in vars(h).items() if isinstance(v, np.ndarray) and v.base is None}
    nbytes = h.nbytes
    for _ in range(50):
        h.add_text([rng.randrange(50) for _ in range(rng.randrange(1, 12))])
    assert h.propose([100, 101, 102], 8) == ()
    assert len(h) <= 32 * 2
    # nothing allocated after construction: the same arrays, the same size
    assert h.nbytes == nbytes and all(getattr(h, k) is v for k, v in arrays.items())
    h.clear()
    assert len(h) == 0 and h.propose([1, 2], 4) == ()


@pytest.mark.parametrize("capacity, matches, max_extend", [(16, (3, 2), 32), (37, (8, 4, 2), 32),
                                                           (23, (5, 3, 1), 4), (2, (2,), 0)])
def test_proposals_are_those_of_a_plain_reference(capacity, matches, max_extend):
    h, ref = SharedHistory(capacity, matches, max_extend), Reference(capacity, matches, max_extend)
    proposed = 0
    for text, queries in random_run(capacity, capacity):
        h.add_text(text)
        ref.add_text(text)
        assert len(h) == len(ref)
        for tokens, max_len in queries:
            assert h.propose(tokens, max_len) == ref.propose(tokens, max_len), (tokens, max_len)
            proposed += bool(ref.propose(tokens, max_len))
    assert proposed > 100 or capacity == 2


@pytest.mark.parametrize("mask", [0, 3])
def test_a_hash_collision_never_proposes_text_that_did_not_follow_the_suffix(mask):
    """With the hash narrowed to a bit or two, different m-grams share one: a lookup finds
    another m-gram's entry, and the ring's own tokens turn it down."""
    h = SharedHistory(64, matches=(2,))
    h._mask = 0
    h.add_text([1, 2, 3])
    h.add_text([4, 5, 6])  # every hash is 0: (4, 5) takes (1, 2)'s entry
    assert h.propose([4, 5], 8) == (6,) and h.propose([1, 2], 8) == () and h.propose([7, 7], 8) == ()
    h, ref = SharedHistory(37, matches=(8, 4, 2)), Reference(37, (8, 4, 2), 32)
    h._mask = mask
    proposed = 0
    for text, queries in random_run(1, 37):
        h.add_text(text)
        ref.add_text(text)
        for tokens, max_len in queries + [(text[:-1], 8)]:
            if out := h.propose(tokens, max_len):
                assert ref.followed(tokens, out), (tokens, out)
                proposed += 1
    assert proposed > 50


def test_nbytes_counts_the_ring_and_the_index():
    h = SharedHistory(1000)
    arrays = [v for v in vars(h).values() if isinstance(v, np.ndarray) and v.base is None]
    assert h.ring.nbytes == 8000 and h.nbytes > h.ring.nbytes
    assert h.nbytes == sum(a.nbytes for a in arrays) and len(arrays) >= 2


def test_a_deep_copy_is_a_history_of_its_own():
    """The benchmark copies the engine's history to replay each configuration from one state."""
    h = SharedHistory(64, matches=(4, 2))
    h.add_text([1, 2, 3, 4, 5, 6])
    c = copy.deepcopy(h)
    c.add_text([1, 2, 3, 4, 9])
    assert h.propose([1, 2, 3, 4], 8) == (5, 6) and c.propose([1, 2, 3, 4], 8) == (9,)
    assert c.nbytes == h.nbytes and np.shares_memory(c._hash_windows, c._hash)


def test_proposes_what_followed_the_last_earlier_match():
    text = [1, 2, 3, 4, 5, 9, 1, 2]
    idx = SuffixIndex(2)
    idx.extend(text)
    assert idx.propose(text, 3) == (3, 4, 5)
    assert idx.propose(text, 10) == (3, 4, 5, 9, 1, 2)


def test_most_recent_occurrence_wins():
    text = [1, 2, 3, 1, 2, 7, 1, 2]
    idx = SuffixIndex(2)
    idx.extend(text)
    assert idx.propose(text, 2) == (7, 1)


def test_no_match_and_the_suffix_itself_are_not_proposed():
    text = [1, 2, 3, 4]
    idx = SuffixIndex(2)
    idx.extend(text)
    assert idx.propose(text, 4) == ()
    assert idx.propose(text, 0) == ()


def test_extend_indexes_only_new_tokens_and_sees_them():
    text = [1, 2]
    idx = SuffixIndex(2)
    idx.extend(text)
    text += [3, 1, 2]
    assert idx.propose(text, 4) == ()  # (1, 2) -> 3 is not in the table until extended
    idx.extend(text)
    assert idx.propose(text, 4) == (3, 1, 2)


def test_match_length_must_be_positive():
    with pytest.raises(ValueError, match="suffix match"):
        SuffixIndex(0)

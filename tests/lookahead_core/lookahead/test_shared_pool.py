import pytest

from lookahead_core.lookahead.shared_pool import SharedNGramPool


def test_fill_tops_up_without_duplicates_most_recent_first():
    shared = SharedNGramPool(cap=4, max_keys=16)
    shared.track(3)
    shared.add_text([1, 2, 3, 1, 4, 5, 1, 6, 7])
    cands = [(4, 5)]
    shared.fill(3, 1, cands, g=3)
    assert cands == [(4, 5), (6, 7), (2, 3)]
    full = [(9, 9)]
    shared.fill(3, 1, full, g=1)
    assert full == [(9, 9)]


def test_only_tracked_sizes_collect_text():
    shared = SharedNGramPool(cap=4, max_keys=16)
    shared.add_text([1, 2, 3])  # nothing tracked yet: not kept
    shared.track(2)
    shared.track(2)
    cands: list = []
    shared.fill(3, 1, cands, g=2)
    assert cands == [] and len(shared) == 0
    shared.add_text([1, 2, 3])
    shared.fill(2, 1, cands, g=2)
    assert cands == [(2,)] and len(shared) == 2


def test_bounded_and_cleared():
    shared = SharedNGramPool(cap=2, max_keys=3)
    shared.track(2)
    shared.add_text(list(range(100)) + [0, 7, 0, 8, 0, 9])
    assert len(shared) <= 3 * 2
    cands: list = []
    shared.fill(2, 0, cands, g=4)
    assert cands == [(9,), (8,)]  # cap 2: the two most recent continuations
    shared.clear()
    assert len(shared) == 0
    with pytest.raises(ValueError):
        SharedNGramPool(cap=0, max_keys=4)


def test_only_the_tail_of_a_text_is_added():
    shared = SharedNGramPool(cap=4, max_keys=16, tail=4)
    shared.track(2)
    shared.add_text([1, 2, 3, 4, 5, 6])  # only 3, 4, 5, 6 count
    assert len(shared) == 3
    cands: list = []
    shared.fill(2, 1, cands, g=2)
    assert cands == []
    with pytest.raises(ValueError):
        SharedNGramPool(cap=1, max_keys=1, tail=1)


def test_a_full_pool_evicts_its_oldest_keys_first_text_after_text():
    shared = SharedNGramPool(cap=2, max_keys=50)
    shared.track(2)
    for start in range(0, 1000, 10):  # 100 texts of 10 new first tokens each
        shared.add_text(list(range(start, start + 11)))
    kept = []
    for k in range(1000):
        cands: list = []
        shared.fill(2, k, cands, g=1)
        kept += [k] if cands else []
    assert kept == list(range(950, 1000)) and len(shared) == 50


def test_a_full_pool_stays_within_its_bound():
    """The memory plan counts `bytes_bound`: fill every key to its cap with texts that share no
    token objects and measure what the pool holds."""
    import random
    import tracemalloc

    vocab, sizes = 5000, (2, 3, 5)
    shared = SharedNGramPool(cap=4, max_keys=256, tail=4096)
    for n in sizes:
        shared.track(n)
    bound = shared.bytes_bound(sizes, vocab)
    rng = random.Random(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(4):
            shared.add_text([rng.randrange(300, 300 + 256) for _ in range(4096)])  # 256 keys, no cached ints
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(shared) == len(sizes) * 256 * 4  # every key at its cap
    assert 0.3 * bound < held <= bound
    # the vocabulary bounds the keys
    assert shared.bytes_bound(sizes, 16) < shared.bytes_bound(sizes, vocab)

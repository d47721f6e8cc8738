import pytest

from lookahead_core.lookahead.ngram_pool import NGramPool


def test_lookup_returns_most_recent_first():
    pool = NGramPool(n=3, cap=4)
    pool.add(7, (1, 2))
    pool.add(7, (3, 4))
    assert pool.lookup(7) == [(3, 4), (1, 2)]
    assert pool.lookup(8) == []


def test_cap_evicts_least_recently_seen():
    pool = NGramPool(n=2, cap=2)
    pool.add(1, (10,))
    pool.add(1, (11,))
    pool.add(1, (10,))  # seen again: now the most recent
    pool.add(1, (12,))  # evicts (11,)
    assert pool.lookup(1) == [(12,), (10,)]
    assert len(pool) == 2


def test_cap_is_per_key():
    pool = NGramPool(n=2, cap=1)
    pool.add(1, (5,))
    pool.add(2, (6,))
    assert pool.lookup(1) == [(5,)] and pool.lookup(2) == [(6,)]


def test_zero_cap_holds_nothing():
    pool = NGramPool(n=2, cap=0)
    pool.add(1, (5,))
    assert pool.lookup(1) == [] and len(pool) == 0


def test_add_sequence_adds_every_ngram_from_start():
    pool = NGramPool(n=3, cap=8)
    pool.add_sequence([1, 2, 3, 4, 1, 2, 5])
    assert pool.lookup(1) == [(2, 5), (2, 3)]
    assert pool.lookup(3) == [(4, 1)]
    only_new = NGramPool(n=3, cap=8)
    only_new.add_sequence([1, 2, 3, 4, 5], start=2)  # n-grams ending at index >= 4
    assert len(only_new) == 1 and only_new.lookup(3) == [(4, 5)]


def test_invalid_sizes():
    with pytest.raises(ValueError):
        NGramPool(n=1, cap=2)
    with pytest.raises(ValueError):
        NGramPool(n=2, cap=-1)


def test_max_keys_evicts_the_key_added_longest_ago():
    pool = NGramPool(n=2, cap=2, max_keys=2)
    pool.add(1, (5,))
    pool.add(2, (6,))
    pool.add(1, (7,))  # an existing key: nothing evicted
    pool.add(3, (8,))  # a third key: key 1, the first added, goes
    assert pool.lookup(1) == [] and pool.lookup(2) == [(6,)] and pool.lookup(3) == [(8,)]
    with pytest.raises(ValueError):
        NGramPool(n=2, cap=2, max_keys=0)


def test_clear_empties_the_pool():
    pool = NGramPool(n=3, cap=4)
    pool.add_sequence([1, 2, 3, 4])
    pool.clear()
    assert len(pool) == 0 and pool.lookup(1) == []


def test_its_size_is_kept_as_it_changes():
    import random

    rng = random.Random(0)
    pool = NGramPool(3, cap=3, max_keys=20)
    for _ in range(2000):
        pool.add(rng.randrange(40), (rng.randrange(5), rng.randrange(5)))
        assert len(pool) == sum(len(c) for c in pool._table.values())
    pool.clear()
    assert len(pool) == 0


def test_its_size_can_be_read_while_another_thread_adds():
    """/health reads the pools' sizes on the event loop while the engine thread adds text: a read
    that iterated the table raised "dictionary changed size during iteration"."""
    import sys
    import threading

    pool = NGramPool(2, cap=2, max_keys=5000)
    stop = threading.Event()

    def writer():
        k = 0
        while not stop.is_set():
            pool.add(k % 10000, (k,))
            k += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        sizes = [len(pool) for _ in range(20000)]
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert max(sizes) <= 5000 * 2


@pytest.mark.parametrize("n, cap, max_keys", [(2, 1, 3), (3, 2, 5), (4, 8, None), (3, 0, 2), (5, 3, 40)])
def test_add_sequence_is_add_of_each_ngram_in_turn(n, cap, max_keys):
    """`add_sequence` inlines `add`: the same continuations, recency, evicted keys and size."""
    import random

    rng = random.Random(n * 100 + cap)
    seq, each = NGramPool(n, cap, max_keys), NGramPool(n, cap, max_keys)
    for _ in range(300):
        tokens = [rng.randrange(rng.choice([3, 60])) for _ in range(rng.randrange(0, 30))]
        start = rng.randrange(-2, 8)
        seq.add_sequence(tokens, start)
        for i in range(max(start, 0), len(tokens) - n + 1):
            each.add(tokens[i], tuple(tokens[i + 1 : i + n]))
        assert len(seq) == len(each) == sum(len(seq.lookup(k)) for k in range(60))
        assert all(seq.lookup(k) == each.lookup(k) for k in range(60))

"""ReplicaKnowledge: one owner of what a replica learns across requests, cleared and restored whole."""
from types import SimpleNamespace

import numpy as np
import pytest

from lookahead_core.lookahead.knowledge import ReplicaKnowledge
from lookahead_core.lookahead.tree import Source

V = 64
ON = SimpleNamespace(shared_pool_cap=4, max_n=4, shared_pool_keys=64, shared_pool_text=64, history_tokens=256,
                     successor_topk=2, max_successors=8)
OFF = SimpleNamespace(**{**vars(ON), "shared_pool_cap": 0, "history_tokens": 0, "successor_topk": 0})


def _learn(k: ReplicaKnowledge, seed: int) -> None:
    """A little of everything the engine and its requests feed the tables."""
    rng = np.random.default_rng(seed)
    text = rng.integers(2, V, 40).tolist()
    k.add_finished_text(text + text[:12])
    ids = np.array([text[:5]])
    k.observe_forward(ids, rng.integers(0, V, (1, 5, 3)), [4])
    k.observe_prefill(np.array(text[5:9]), rng.integers(0, V, (4, 2)))
    depth = np.array([1, 2, 1, 3])
    k.row_rates[False].observe(np.array([Source.POOL, Source.POOL, Source.HISTORY, Source.SHARED]), depth,
                               rng.random(4) < 0.5)
    k.row_rates[True].observe(np.array([Source.LOOKUP]), np.array([1]), np.array([seed % 2 == 0]))
    k.full_yields.observe(False, bool(seed % 2), int(rng.integers(1, 6)))
    if k.successors is not None:
        k.successors.observe([0, 1, 2], [int(rng.integers(0, 3))], bool(seed % 2))


def _proposals(k: ReplicaKnowledge, seed: int) -> tuple:
    """What the tables offer a request whose text repeats `_learn(seed)`'s, and the rates it is priced by."""
    text = np.random.default_rng(seed).integers(2, V, 40).tolist()
    cands: list = []
    if k.shared_pool is not None:
        k.shared_pool.fill(3, text[10], cands, 4)
    hist = k.history.propose(text[:12], 8) if k.history is not None else None
    succ = k.successors.propose(text[0], 8) if k.successors is not None else None
    node = k.successors.rates(True).tolist() if k.successors is not None else None
    return (cands, hist, succ, node, k.row_rates[False].rates().tolist(), k.row_rates[True].rates().tolist(),
            dict(k.full_yields.means))


def _tables(k: ReplicaKnowledge) -> list:
    return [k.shared_pool, k.history, k.successors, k.row_rates[False], k.row_rates[True], k.full_yields]


def test_restore_returns_to_the_snapshot_in_the_same_tables():
    k = ReplicaKnowledge(ON, V)
    k.shared_pool.track(3)  # as a request of n = 3 does
    _learn(k, 1)
    status, offered = k.status(), _proposals(k, 1)
    assert offered[0] and offered[1] and offered[2][0]  # the test learns something every table offers
    snap = k.snapshot()
    held = _tables(k)
    _learn(k, 2)
    assert (k.status(), _proposals(k, 1)) != (status, offered)
    k.restore(snap)
    assert k.status() == status and _proposals(k, 1) == offered
    # requests and pacers hold the tables themselves: restored in place, never replaced
    assert all(a is b for a, b in zip(_tables(k), held))
    _learn(k, 3)  # the snapshot holds for another restore, and the restored history learns on
    k.restore(snap)
    assert k.status() == status and _proposals(k, 1) == offered
    _learn(k, 2)
    assert k.history.propose(np.random.default_rng(2).integers(2, V, 40).tolist()[:12], 8)


def test_clear_forgets_everything_learned():
    fresh = ReplicaKnowledge(ON, V)
    k = ReplicaKnowledge(ON, V)
    k.shared_pool.track(3)
    for seed in range(3):
        _learn(k, seed)
    assert k.status() != fresh.status()
    held = _tables(k)
    k.clear()
    assert k.status() == fresh.status() and _proposals(k, 1) == _proposals(fresh, 1)
    assert all(a is b for a, b in zip(_tables(k), held))


def test_tables_the_config_turns_off_are_none():
    k = ReplicaKnowledge(OFF, V)
    assert k.shared_pool is None and k.history is None and k.successors is None
    status = k.status()
    assert status["shared_pool"] is None and status["text"] is None and status["successors"] is None
    _learn(k, 1)
    learned, snap = k.status(), k.snapshot()
    assert learned != status
    k.clear()
    assert k.status() == status
    k.restore(snap)
    assert k.status() == learned
    with pytest.raises(ValueError, match="other tables"):
        ReplicaKnowledge(ON, V).restore(snap)


def test_only_the_real_rows_of_a_step_teach_successors():
    k = ReplicaKnowledge(ON, V)
    ids = np.array([[5, 6, 7], [8, 0, 0]])  # row 1: one real token, then padding
    tokens = np.arange(2 * 3 * 3).reshape(2, 3, 3)  # (greedy, top-1, top-2) per row
    k.observe_forward(ids, tokens, [3, 1])
    assert k.successors.table[[5, 6, 7, 8]].tolist() == [[1, 2], [4, 5], [7, 8], [10, 11]]
    assert (k.successors.table[0] == -1).all()
    assert k.status()["successors"]["tokens_known"] == 4


def test_the_history_gets_the_tail_the_pool_gets():
    k = ReplicaKnowledge(SimpleNamespace(**{**vars(ON), "shared_pool_text": 6}), V)
    k.add_finished_text(list(range(2, 30)))
    assert k.history.written == 6 + 1  # the text's last 6 tokens and a gap


def test_planned_bytes_count_every_table_and_the_pool_at_its_bound():
    on, off = ReplicaKnowledge(ON, V), ReplicaKnowledge(OFF, V)
    arrays = on.history.nbytes + on.successors.nbytes + sum(r.nbytes for r in on.row_rates.values())
    assert on.planned_bytes == arrays + on.shared_pool.bytes_bound(range(2, ON.max_n + 1), V)
    assert off.planned_bytes == sum(r.nbytes for r in off.row_rates.values())
    assert on.status()["planned_bytes"] == on.planned_bytes

import numpy as np
import pytest

from lookahead_core.lookahead.successors import RANK_HIT_RATE, SuccessorTable, tree_template
from lookahead_core.lookahead.tree import CandidateTree, Source


def test_template_takes_the_likeliest_rank_paths_parents_first():
    tpl = tree_template(6, 3, rates=(0.5, 0.2, 0.1))
    # 0.5 (rank 0), 0.25 (0,0), 0.2 (rank 1), 0.125 (0,0,0), 0.1 (rank 2 and (0,1)): parents first
    assert tpl[:4] == [(-1, 0), (0, 0), (-1, 1), (1, 0)]
    assert all(parent < node for node, (parent, _) in enumerate(tpl))
    assert len(tree_template(40, 8)) == 40 and tree_template(3, 1) == [(-1, 0), (0, 0), (1, 0)]


def test_propose_expands_the_last_token_through_the_table():
    table = SuccessorTable(vocab=10, k=2, max_nodes=6)
    assert table.propose(1, 6) == ([], [])  # nothing recorded yet
    table.update(np.array([1, 2]), np.array([[2, 3], [4, 5]]))
    paths, nodes = table.propose(1, 6)
    # 1 -> 2 -> 4 (rank 0 twice), 1 -> 3 (rank 1), 1 -> 2 -> 5; 3 and 4 have no successors yet
    assert set(paths) == {(2,), (2, 4), (3,), (2, 5)} and len(nodes) == len(paths)
    assert all(table.template[n][0] == -1 or paths[nodes.index(table.template[n][0])] == p[:-1]
               for p, n in zip(paths, nodes))
    assert table.known == 2 and table.nbytes >= 10 * 2 * 4
    keep = np.ones(table.max_nodes, dtype=bool)
    keep[nodes[paths.index((2,))]] = False  # leaving out a node leaves out its subtree
    assert set(table.propose(1, 6, keep)[0]) == {(3,)}
    assert table.propose(1, 1)[0] == [(2,)]


def test_later_rows_win_and_observed_rates_move_from_the_prior():
    table = SuccessorTable(vocab=10, k=2, max_nodes=4)
    table.update(np.array([1, 1]), np.array([[2, 3], [4, 5]]))
    assert table.table[1].tolist() == [4, 5]
    before = table.rates().copy()
    assert before[0] == pytest.approx(RANK_HIT_RATE[0])
    for _ in range(20):
        table.observe([0, 1], [0])
    after = table.rates()
    assert after[0] > before[0] and after[1] < before[1]
    assert np.array_equal(table.rates(sampled=True), before)  # greedy steps leave sampled requests' rates
    for _ in range(20):
        table.observe([0], [], sampled=True)
    assert table.rates(sampled=True)[0] < before[0] and np.array_equal(table.rates(), after)
    table.clear()
    assert table.known == 0 and table.rates()[0] == table.rates(True)[0] == pytest.approx(RANK_HIT_RATE[0])


def test_tree_rows_remember_their_source_and_tag():
    tree = CandidateTree(8)
    tree.build([(5, 6), (5, 7), (9,)], sources=[Source.LOOKUP, Source.SUCCESSORS, Source.SUCCESSORS], tags=[-1, 3, 0])
    assert tree.tokens[: tree.size].tolist() == [5, 6, 7, 9]
    # row 0 (token 5) was added by the lookup candidate; the successor path only added its 7
    assert tree.source[: tree.size].tolist() == [Source.LOOKUP, Source.LOOKUP, Source.SUCCESSORS, Source.SUCCESSORS]
    assert tree.tag[: tree.size].tolist() == [-1, -1, 3, 0]

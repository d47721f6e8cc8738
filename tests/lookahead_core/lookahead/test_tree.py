import numpy as np

from lookahead_core.lookahead.tree import CandidateTree, Source

# step rows: 0 = last token, tree rows from step row 1 on
ROW0 = 1


def test_shared_prefixes_share_rows():
    tree = CandidateTree(8)
    assert tree.build([(5, 6, 7), (5, 6, 9), (4, 1)]) == 6
    assert tree.tokens[:6].tolist() == [5, 6, 7, 9, 4, 1]
    assert tree.depth[:6].tolist() == [1, 2, 3, 3, 1, 2]
    assert tree.paths == [[0, 1, 2], [0, 1, 3], [4, 5]]


def test_each_row_sees_its_ancestors_and_itself_only():
    tree = CandidateTree(8)
    tree.build([(5, 6, 7), (5, 6, 9), (4, 1)])
    seen = [set(np.flatnonzero(tree.visible[r, :6])) for r in range(6)]
    assert seen == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 3}, {4}, {4, 5}]


def test_rebuild_clears_the_previous_tree():
    tree = CandidateTree(8)
    tree.build([(1, 2, 3, 4, 5, 6)])
    tree.build([(7,), (8,)])
    assert tree.size == 2 and not tree.visible[1, 0]
    assert not tree.visible[:, 2:].any()


def test_duplicates_and_prefixes_add_no_rows():
    tree = CandidateTree(8)
    assert tree.build([(5, 6), (5, 6), (5,)]) == 2
    assert tree.candidates == [(5, 6), (5,)]


def test_budget_cuts_candidates_in_priority_order():
    tree = CandidateTree(8)
    assert tree.build([(1, 2, 3), (1, 4, 5), (6, 7)], budget=4) == 4
    assert tree.candidates == [(1, 2, 3), (1, 4)]
    assert tree.paths == [[0, 1, 2], [0, 3]]
    # a candidate that fits in rows already there is kept after the budget is spent
    tree.build([(1, 2, 3), (9,), (1, 2)], budget=3)
    assert tree.candidates == [(1, 2, 3), (1, 2)]


def test_walk_follows_the_models_argmax():
    tree = CandidateTree(8)
    tree.build([(5, 6, 7), (5, 6, 9), (4, 1)])
    # argmax after: last -> 5, after 5 -> 6, after 6 -> 9, after 9 -> 2
    preds = [5, 6, 9, 0, 2, 0, 0]
    assert tree.walk_greedy(preds, ROW0) == ([0, 1, 3], [5, 6, 9, 2])


def test_walk_with_no_match_gives_the_models_next_token():
    tree = CandidateTree(8)
    tree.build([(5, 6)])
    assert tree.walk_greedy([3, 0, 0], ROW0) == ([], [3])
    tree.build([])
    assert tree.walk_greedy([42], ROW0) == ([], [42])


def test_walk_breaks_where_the_model_disagrees():
    tree = CandidateTree(8)
    tree.build([(5, 6, 7)])
    # rows start after a 4-row window
    preds = [5, 0, 0, 0, 0, 6, 8, 0]
    assert tree.walk_greedy(preds, 5) == ([0, 1], [5, 6, 8])


def test_keep_rebuilds_with_the_chosen_rows_and_their_labels():
    tree = CandidateTree(16)
    tree.build([(5, 6, 7), (5, 8), (9,)], sources=[Source.LOOKUP, Source.POOL, Source.SUCCESSORS], tags=[-1, -1, 3])
    assert tree.size == 5 and tree.parent[:5].tolist() == [-1, 0, 1, 0, -1]
    assert tree.keep([0, 3, 4]) == 3  # 5, 5->8, 9: the rows kept, parents included
    assert tree.candidates == [(5,), (5, 8), (9,)]
    assert tree.tokens[:3].tolist() == [5, 8, 9] and tree.depth[:3].tolist() == [1, 2, 1]
    assert tree.source[:3].tolist() == [Source.LOOKUP, Source.POOL, Source.SUCCESSORS]
    assert tree.tag[:3].tolist() == [-1, -1, 3] and tree.parent[:3].tolist() == [-1, 0, -1]
    assert tree.visible[:3, :3].tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    assert tree.walk_greedy([5, 8, 0, 0, 1], 1) == ([0, 1], [5, 8, 0])

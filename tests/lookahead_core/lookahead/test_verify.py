"""verify: the longest tree path the model produced, cut by the stop rule, as a Verdict value."""
from lookahead_core.lookahead.stopping import FinishReason, StopCondition
from lookahead_core.lookahead.tree import CandidateTree, Source
from lookahead_core.lookahead.verify import verify

START = 4  # tree rows from step row 4 on: the last token and a window of 3 before them


def _tree() -> CandidateTree:
    tree = CandidateTree(8)
    tree.build([(5, 6, 7), (5, 9), (8,)], sources=[Source.LOOKUP, Source.POOL, Source.POOL])
    return tree  # rows: 5@0, 6@1, 7@2, 9@3, 8@4


def _pred(after: dict[int, int], default: int = 99) -> list[int]:
    """The argmax of each step row: `after[tree row]`, `after[-1]` for the last token's row."""
    pred = [default] * (START + 5)
    pred[0] = after[-1]
    for row, token in after.items():
        if row >= 0:
            pred[START + row] = token
    return pred


def test_the_model_s_own_path_is_accepted_with_its_bonus_token():
    v = verify(_tree(), START, _pred({-1: 5, 0: 6, 1: 7, 2: 42}), StopCondition(16), produced=0)
    assert v.tokens == [5, 6, 7, 42] and v.tree_rows == [0, 1, 2] and v.kv_rows == [4, 5, 6]
    assert v.finish_reason is None
    assert v.sources == ((3, 2, 0, 0, 0, 0), (3, 0, 0, 0, 0, 0))  # rows by source: proposed, accepted


def test_a_branch_the_model_leaves_ends_the_walk():
    v = verify(_tree(), START, _pred({-1: 5, 0: 9, 3: 1}), StopCondition(16), produced=0)
    assert v.tokens == [5, 9, 1] and v.tree_rows == [0, 3] and v.sources[1] == (1, 1, 0, 0, 0, 0)


def test_the_stop_rule_cuts_the_accepted_block_and_the_rows_it_keeps():
    eos = verify(_tree(), START, _pred({-1: 5, 0: 6, 1: 7, 2: 42}), StopCondition(16, eos_ids=frozenset({6})), 0)
    assert eos.tokens == [5, 6] and eos.kv_rows == [4] and eos.finish_reason is FinishReason.EOS
    room = verify(_tree(), START, _pred({-1: 5, 0: 6, 1: 7, 2: 42}), StopCondition(16), produced=14)
    assert room.tokens == [5, 6] and room.finish_reason is FinishReason.LENGTH


def test_a_sampled_walk_follows_the_drawn_tokens():
    drawn = {0: 5, START + 0: 9, START + 3: 2}  # drawn where the walk went: not row 1's argmax
    v = verify(_tree(), START, _pred({-1: 5, 0: 6, 1: 7}), StopCondition(16), 0, drawn)
    assert v.tokens == [5, 9, 2] and v.tree_rows == [0, 3]


def test_a_one_token_step_has_no_tree():
    v = verify(None, 1, [17], StopCondition(16), produced=3)
    assert v.tokens == [17] and v.tree_rows == [] and v.kv_rows == [] and v.sources is None

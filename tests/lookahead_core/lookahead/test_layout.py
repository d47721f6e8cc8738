import numpy as np
import torch

from lookahead_core import LookaheadParams
from lookahead_core.lookahead.layout import StepLayout


def _layout(n, w, g, lookup=0, successors=0):
    return StepLayout(LookaheadParams(n, w, g, lookup=lookup, successors=successors), torch.float32, "cpu")


def test_sizes_and_rows():
    lay = _layout(4, 3, 2, lookup=5, successors=7)
    assert lay.window_len == 9 and lay.cand_start == 10
    assert lay.max_tree_rows == 2 * 3 + 5 + 7 and lay.max_tokens == 10 + 18
    assert lay.newest_level_start == 7


def test_window_token_sees_its_chain_only():
    lay = _layout(4, 3, 2)
    v = lay.visible
    w0 = lambda level, j: 1 + level * 3 + j  # noqa: E731
    # level 2, column 1 sees: last, level0 cols 0..1, level1 col 1, itself
    row = w0(2, 1)
    seen = set(np.flatnonzero(v[row]))
    assert seen == {0, w0(0, 0), w0(0, 1), w0(1, 1), w0(2, 1)}
    # level 0 is causal among itself
    assert set(np.flatnonzero(v[w0(0, 2)])) == {0, w0(0, 0), w0(0, 1), w0(0, 2)}


def test_window_positions_follow_each_chain():
    lay = _layout(4, 3, 2)
    # window (level, j) sits at 1 + level + j after the last token
    assert lay.offsets[0] == 0
    assert lay.offsets[1 + 2 * 3 + 1] == 1 + 2 + 1
    # every visible key of a row sits at a strictly smaller position, except the row itself
    for row in range(lay.cand_start):
        for col in np.flatnonzero(lay.visible[row]):
            assert col == row or lay.offsets[col] < lay.offsets[row]


def test_tree_rows_see_the_last_token_and_themselves_until_the_step_adds_ancestors():
    lay = _layout(3, 2, 3, lookup=4)
    v = lay.visible
    for row in range(lay.cand_start, lay.max_tokens):
        assert set(np.flatnonzero(v[row])) == {0, row}


def test_mask_template_is_float_zero_or_min():
    lay = _layout(3, 2, 2)
    t = lay.mask_template
    assert t.dtype == torch.float32
    assert torch.equal(t == 0, torch.from_numpy(lay.visible))
    assert (t[~torch.from_numpy(lay.visible)] == torch.finfo(torch.float32).min).all()


def test_plain_layout_is_one_token():
    lay = StepLayout(None, torch.float32, "cpu")
    assert lay.max_tokens == 1 and lay.max_tree_rows == 0
    assert lay.mask_template.tolist() == [[0.0]]

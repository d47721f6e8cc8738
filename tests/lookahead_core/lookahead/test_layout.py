import numpy as np
import torch

from lookahead_core import LookaheadParams
from lookahead_core.lookahead.layout import StepLayout


def _layout(n, w, g):
    return StepLayout(LookaheadParams(n, w, g), torch.float32, "cpu")


def test_sizes_and_rows():
    lay = _layout(4, 3, 2)
    assert lay.window_len == 9 and lay.cand_start == 10 and lay.max_tokens == 16
    assert lay.newest_level_start == 7
    assert lay.step_tokens(0) == 10 and lay.step_tokens(2) == 16
    assert lay.candidate_row(1) == 13


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


def test_positions_follow_each_chain():
    lay = _layout(4, 3, 2)
    # window (level, j) sits at 1 + level + j after the last token; candidates at 1..n-1
    assert lay.offsets[0] == 0
    assert lay.offsets[1 + 2 * 3 + 1] == 1 + 2 + 1
    assert list(lay.offsets[lay.cand_start :]) == [1, 2, 3, 1, 2, 3]
    # every visible key of a row sits at a strictly smaller position, except the row itself
    for row in range(lay.max_tokens):
        for col in np.flatnonzero(lay.visible[row]):
            assert col == row or lay.offsets[col] < lay.offsets[row]


def test_candidates_see_last_token_and_their_own_prefix():
    lay = _layout(3, 2, 3)
    v = lay.visible
    c1 = lay.candidate_row(1)
    assert set(np.flatnonzero(v[c1 + 1])) == {0, c1, c1 + 1}
    # no candidate sees the window or another candidate
    assert not v[lay.cand_start :, 1 : lay.cand_start].any()
    assert not v[c1, lay.candidate_row(0)] and not v[lay.candidate_row(0), c1]


def test_mask_template_is_float_zero_or_min():
    lay = _layout(3, 2, 2)
    t = lay.mask_template
    assert t.dtype == torch.float32
    assert torch.equal(t == 0, torch.from_numpy(lay.visible))
    assert (t[~torch.from_numpy(lay.visible)] == torch.finfo(torch.float32).min).all()


def test_fewer_candidates_is_the_top_left_corner():
    lay = _layout(3, 2, 3)
    full = _layout(3, 2, 1)
    k = full.max_tokens
    assert np.array_equal(lay.visible[:k, :k], full.visible)


def test_plain_layout_is_one_token():
    lay = StepLayout(None, torch.float32, "cpu")
    assert lay.max_tokens == 1 and lay.step_tokens(0) == 1
    assert lay.mask_template.tolist() == [[0.0]]

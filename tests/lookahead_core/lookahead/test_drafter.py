"""Drafter: one request's candidates ranked into a Draft, its span of the step written, a verdict learned."""
import numpy as np
import pytest
import torch

from lookahead_core.lookahead.drafter import Drafter
from lookahead_core.lookahead.layout import StepLayout
from lookahead_core.lookahead.pacing import StepChoice, StepKind
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.stopping import StopCondition
from lookahead_core.lookahead.tree import Source
from lookahead_core.lookahead.verify import verify

PARAMS = LookaheadParams(3, 2, 2, lookup=4, successors=0)
PROMPT = [1, 2, 3, 4, 5, 6, 1, 2]  # "1 2" came before: prompt lookup copies "3 4 5 6"


def _drafter(tokens=PROMPT) -> Drafter:
    layout = StepLayout(PARAMS, torch.float32, "cpu")
    return Drafter(PARAMS, layout, list(tokens), sampled=False)


def test_a_draft_ranks_its_rows_likeliest_first_and_never_a_child_before_its_parent():
    d = _drafter()
    draft = d.draft(PROMPT)
    tree = draft.tree
    assert draft.copied and tree.candidates[0] == (3, 4, 5, 6) and tree.source[0] == Source.LOOKUP
    assert (np.diff(draft.odds) <= 0).all() and len(draft.order) == tree.size
    rank = {int(r): i for i, r in enumerate(draft.order)}
    assert all(rank[int(tree.parent[r])] < rank[r] for r in range(tree.size) if tree.parent[r] >= 0)
    assert draft.full_start == d.layout.cand_start and draft.pacer is d.pacer


def test_write_lays_out_each_kind_and_keeps_the_chosen_rows():
    d = _drafter()
    lay = d.layout
    full = d.write(d.draft(PROMPT), StepChoice(StepKind.FULL, rows=2), last=2)
    ids = full.ids
    assert full.width == lay.cand_start + 2 and full.cand_start == lay.cand_start and ids[0] == 2
    assert ids[lay.window_start : lay.cand_start].tolist() == d.window.flat()
    assert ids[lay.cand_start : full.width].tolist() == [3, 4]  # the copied run's first two rows, likeliest
    verify_span = d.write(d.draft(PROMPT), StepChoice(StepKind.VERIFY, rows=3), last=2)
    assert verify_span.width == 1 + 3 and ids[1:4].tolist() == [3, 4, 5]
    assert verify_span.offsets[1:4].tolist() == [1, 2, 3]  # positions after the last token: tree depths
    plain = d.write(d.draft(PROMPT), StepChoice(StepKind.PLAIN), last=2)
    assert plain.width == 1 and plain.ids is None and d.tree.size == 0


def test_learn_shifts_the_window_and_teaches_the_pool_and_the_pacer():
    d = _drafter()
    lay = d.layout
    draft = d.draft(PROMPT)
    span = d.write(draft, StepChoice(StepKind.FULL, copied=draft.copied), last=2)
    pred = [0] * span.width  # the model continues the copied run (tree rows 0-3), then says 7
    pred[0], pred[span.cand_start : span.cand_start + 4] = 3, [4, 5, 6, 7]
    pred[lay.newest_level_start : lay.cand_start] = [40, 41]
    verdict = verify(draft.tree, span.cand_start, pred, StopCondition(16), produced=0)
    assert verdict.tokens == [3, 4, 5, 6, 7]
    tokens = PROMPT + verdict.tokens
    yields = d.pacer.yields[True]
    d.learn(span, verdict, pred, tokens)
    assert d.window.levels[-1] == [40, 41]
    assert (6, 7) in d.pool.lookup(5)  # the accepted text's n-grams
    assert d.pacer.yields[True] != yields  # a whole step with a copied run: its yield learned


def test_a_draft_is_written_only_while_it_is_the_latest():
    d = _drafter()
    old = d.draft(PROMPT)
    d.draft(PROMPT)  # its tree buffer now holds the newer draft
    with pytest.raises(ValueError, match="stale"):
        d.write(old, StepChoice(StepKind.FULL), last=2)

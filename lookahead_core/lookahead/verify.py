"""A step's verdict for one request: the longest tree path the model itself produced, cut by the stop rule."""
from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from lookahead_core.lookahead.stopping import FinishReason, StopCondition
from lookahead_core.lookahead.tree import CandidateTree, Source


@dataclass(frozen=True)
class Verdict:
    """The tokens a step accepted (the bonus token included, after the stop rule), the tree rows
    they came from, the step rows whose keys and values stay (behind the last token), the tree
    rows by `Source` (proposed, accepted; None where the step had no tree rows) and the finish reason."""

    tokens: list[int]
    tree_rows: list[int]
    kv_rows: list[int]
    sources: tuple[tuple[int, ...], tuple[int, ...]] | None
    finish_reason: FinishReason | None


def verify(tree: CandidateTree | None, cand_start: int, pred: Seq[int], stop: StopCondition, produced: int,
           drawn: Mapping[int, int] | None = None) -> Verdict:
    """Walk the tree (its rows at step rows `cand_start`...) along the model's argmax per step row
    (`pred`) or, for a sampled request, the tokens drawn along its walk (`drawn`: step row -> token,
    a walk never reaches a row not drawn); `produced`: new tokens before this step. No tree: a
    one-token step."""
    if drawn is not None:
        walk = [-1] * (cand_start + (tree.size if tree is not None else 0))
        for at, token in drawn.items():
            walk[at] = token
        pred = walk
    tree_rows, accepted = tree.walk_greedy(pred, cand_start) if tree is not None else ([], [pred[0]])
    assert accepted[-1] >= 0, "the sampled walk reached a row that was not drawn"
    tokens, reason = stop.clip(accepted, produced)
    kept = tree_rows[: len(tokens) - 1]
    sources = None
    if tree is not None and tree.size:
        src = tree.source[: tree.size]
        sources = (tuple(np.bincount(src, minlength=len(Source)).tolist()),
                   tuple(np.bincount(src[kept], minlength=len(Source)).tolist()))
    return Verdict(tokens, kept, [cand_start + r for r in kept], sources, reason)

"""Greedy verification of pooled candidates against the model's own argmax chain."""
from __future__ import annotations

from collections.abc import Sequence


def verify_greedy(
    predictions: Sequence[int],
    candidates: Sequence[Sequence[int]],
    cand_start: int,
) -> tuple[int, list[int]]:
    """Accept the longest candidate prefix that greedy decoding would produce, plus one token.

    `predictions[r]` is the model's argmax after the token at step row r; row 0 is the last
    accepted token, candidate c occupies rows cand_start + c * len(candidate) onward.
    Returns (index of the accepted candidate, or -1 when none matched, accepted tokens).
    """
    first = predictions[0]
    best, best_len = -1, 0
    for c, cand in enumerate(candidates):
        row = cand_start + c * len(cand)
        expected, k = first, 0
        for tok in cand:
            if tok != expected:
                break
            expected = predictions[row + k]
            k += 1
        if k > best_len:
            best, best_len = c, k
            if k == len(cand):
                break
    if best < 0:
        return -1, [first]
    cand = candidates[best]
    bonus = predictions[cand_start + best * len(cand) + best_len - 1]
    return best, [*cand[:best_len], bonus]

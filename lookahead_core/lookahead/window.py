"""The lookahead branch's 2D window: n - 1 levels of Jacobi history over w positions."""
from __future__ import annotations

from collections.abc import Sequence
from itertools import chain


class LookaheadWindow:
    """Levels 0 (oldest) .. n - 2 (newest), each w tokens.

    Column j of the window is the chain level0[j], level1[j], ..., level(n-2)[j]; with the
    model's next-token output at the top of the column it is the n-gram harvested from that
    column. After a step the oldest level is dropped and the outputs become the newest level.
    """

    def __init__(self, n: int, w: int, seed_tokens: Sequence[int]) -> None:
        if not seed_tokens:
            raise ValueError("the lookahead window needs at least one seed token")
        self.n = n
        self.w = w
        # Column j starts as a contiguous run of real text: level l holds seed[j + l]. Every chain
        # the model reads in the first step is then a slice of the prompt, not noise.
        span = w + n - 2
        seed = list(seed_tokens[-span:])
        while len(seed) < span:
            seed = seed + seed
        seed = seed[-span:]
        self.levels: list[list[int]] = [seed[level : level + w] for level in range(n - 1)]

    def flat(self) -> list[int]:
        """Tokens in step-layout order: level by level."""
        return list(chain.from_iterable(self.levels))

    def update(self, outputs: Sequence[int]) -> list[tuple[int, ...]]:
        """Shift in the model's outputs at the newest level; return each column's n-gram."""
        if len(outputs) != self.w:
            raise ValueError(f"expected {self.w} window outputs, got {len(outputs)}")
        new_level = list(outputs)
        ngrams = list(zip(*self.levels, new_level))
        self.levels = self.levels[1:] + [new_level]
        return ngrams

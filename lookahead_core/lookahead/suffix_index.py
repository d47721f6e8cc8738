"""Prompt lookup over one request's own text: the continuation of the last earlier match of its suffix."""
from __future__ import annotations

from collections.abc import Sequence


class SuffixIndex:
    """For every m-gram of the text, where its most recent continuation starts (m = `match`).

    A reply often repeats runs of its prompt or of itself (names, code, quoted phrases); the
    text after the last earlier occurrence of the current m-token suffix is a candidate of any
    length, which the n-gram pool's fixed n - 1 tokens cannot offer. Updating costs one dict
    write per new token.
    """

    def __init__(self, match: int) -> None:
        if match < 1:
            raise ValueError(f"suffix match length must be >= 1, got {match}")
        self.match = match
        self._next: dict[tuple[int, ...], int] = {}
        self._indexed = match  # continuations starting before this index are in the table

    def extend(self, tokens: Sequence[int]) -> None:
        """Index the m-grams of `tokens` that gained a continuation since the last call."""
        m, table = self.match, self._next
        for i in range(self._indexed, len(tokens)):
            table[tuple(tokens[i - m : i])] = i
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, tokens: Sequence[int], max_len: int) -> tuple[int, ...]:
        """Up to `max_len` tokens that followed the last earlier occurrence of the text's suffix."""
        if max_len <= 0 or len(tokens) < self.match:
            return ()
        start = self._next.get(tuple(tokens[-self.match :]))
        if start is None:
            return ()
        return tuple(tokens[start : start + max_len])

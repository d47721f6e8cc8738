"""The replica's history: finished requests' text, searched by the longest match of a request's suffix."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_GAP = -1  # between two texts in the ring: no continuation crosses it


class SharedHistory:
    """A ring of the last `capacity` tokens of finished requests (prompt tail and output), with an
    index from each m-gram (m in `matches`) to where its latest continuation starts.

    A request whose own text offers no prompt-lookup candidate looks here: the longest of its
    suffixes (of `matches` lengths) seen before, extended backwards as far as it still matches,
    proposes what followed it, as long as the match (SuffixDecoding: a long match predicts a long
    run). Memory is bounded: the ring is allocated once, and a token written over takes its index
    entries with it. What one request's text proposes to another changes its speed, never its tokens.
    """

    def __init__(self, capacity: int, matches: Sequence[int] = (8, 4, 2), max_extend: int = 32) -> None:
        if capacity < 2 or not matches or min(matches) < 1:
            raise ValueError(f"history needs capacity >= 2 and match lengths >= 1, got {capacity}, {matches}")
        self.capacity = capacity
        self.matches = tuple(sorted(set(matches), reverse=True))
        self.max_extend = max_extend
        self.ring = np.full(capacity, _GAP, dtype=np.int64)
        self.written = 0  # tokens ever written; position p lives at ring[p % capacity]
        self._index: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes

    def _token(self, p: int) -> int:
        return int(self.ring[p % self.capacity]) if self.written - self.capacity <= p < self.written else _GAP

    def _key(self, start: int, m: int) -> tuple[int, ...] | None:
        """The m tokens from position `start`, if all are still in the ring and within one text."""
        key = tuple(self._token(p) for p in range(start, start + m))
        return None if _GAP in key else key

    def add_text(self, tokens: Sequence[int]) -> None:
        """Append one finished text (its last `capacity - 1` tokens) and a gap after it."""
        for tok in [*tokens[-(self.capacity - 1) :], _GAP]:
            p = self.written
            if p >= self.capacity:  # position q is overwritten: the m-grams starting there go
                q = p - self.capacity
                for m in self.matches:
                    old = self._key(q, m)
                    if old is not None and self._index.get(old) == q + m:
                        del self._index[old]
            self.ring[p % self.capacity] = tok
            self.written = p + 1
            if tok != _GAP:  # every m-gram ending right before p now continues with tok
                for m in self.matches:
                    key = self._key(p - m, m)
                    if key is not None:
                        self._index[key] = p

    def propose(self, tokens: Sequence[int], max_len: int) -> tuple[int, ...]:
        """What followed the longest earlier match of the text's suffix: as many tokens as matched
        (at least 2, at most `max_len`), cut at the end of that text."""
        if max_len <= 0:
            return ()
        for m in self.matches:
            if len(tokens) < m:
                continue
            start = self._index.get(tuple(tokens[-m:]))
            if start is None:
                continue
            matched = m  # how far back the match goes
            while (matched < self.max_extend and matched < len(tokens)
                   and self._token(start - matched - 1) == tokens[-matched - 1] != _GAP):
                matched += 1
            out = []
            for p in range(start, start + min(max_len, max(2, matched))):
                tok = self._token(p)
                if tok == _GAP:
                    break
                out.append(tok)
            return tuple(out)
        return ()

    def clear(self) -> None:
        self.ring.fill(_GAP)
        self.written = 0
        self._index.clear()

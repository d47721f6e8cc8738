"""The n-gram pool: candidates for verification, keyed by their first token."""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class NGramPool:
    """Maps a token to at most `cap` continuations of `n - 1` tokens, most recently added kept.

    A plain dict per key gives insertion order; re-adding a continuation moves it to the back,
    so the front is always the least recently seen one and is what gets evicted. With
    `max_keys`, a new key beyond that many evicts the key first added longest ago.
    """

    def __init__(self, n: int, cap: int, max_keys: int | None = None) -> None:
        if n < 2:
            raise ValueError(f"n-gram size must be >= 2, got {n}")
        if cap < 0:
            raise ValueError(f"pool cap must be >= 0, got {cap}")
        if max_keys is not None and max_keys < 1:
            raise ValueError(f"pool max_keys must be >= 1, got {max_keys}")
        self.n = n
        self.cap = cap
        self.max_keys = max_keys
        self._table: dict[int, dict[tuple[int, ...], None]] = {}
        # the table's keys in the order they were added: the oldest is found in O(1), where
        # `next(iter(table))` skips every slot emptied since the dict last resized
        self._order: deque[int] = deque()
        # continuations held, kept as they change: /health reads it from another thread, and
        # iterating the table there would race the engine thread's inserts
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, key: int, continuation: tuple[int, ...]) -> None:
        if self.cap == 0:
            return
        conts = self._table.get(key)
        if conts is None:
            if self.max_keys is not None and len(self._table) >= self.max_keys:
                self._size -= len(self._table.pop(self._order.popleft()))
            self._table[key] = {continuation: None}
            self._order.append(key)
            self._size += 1
            return
        if continuation in conts:
            del conts[continuation]
        elif len(conts) >= self.cap:
            del conts[next(iter(conts))]
        else:
            self._size += 1
        conts[continuation] = None

    def add_sequence(self, tokens: Sequence[int], start: int = 0) -> None:
        """Add every n-gram of `tokens` whose last token sits at index >= start + n - 1."""
        lo, hi = max(start, 0), len(tokens) - self.n + 1
        if self.cap == 0 or lo >= hi:
            return
        # `add` for each n-gram in turn, inlined: a finished request adds hundreds per tracked n
        table, order, cap, max_keys, size = self._table, self._order, self.cap, self.max_keys, self._size
        try:
            for key, cont in zip(tokens[lo:hi], zip(*(tokens[lo + j : hi + j] for j in range(1, self.n)))):
                conts = table.get(key)
                if conts is None:
                    if max_keys is not None and len(table) >= max_keys:
                        size -= len(table.pop(order.popleft()))
                    table[key] = {cont: None}
                    order.append(key)
                    size += 1
                    continue
                if cont in conts:
                    del conts[cont]
                elif len(conts) >= cap:
                    del conts[next(iter(conts))]
                else:
                    size += 1
                conts[cont] = None
        finally:
            self._size = size

    def lookup(self, key: int) -> list[tuple[int, ...]]:
        """Continuations of `key`, most recent first."""
        conts = self._table.get(key)
        if not conts:
            return []
        return list(reversed(conts))

    def clear(self) -> None:
        self._table.clear()
        self._order.clear()
        self._size = 0

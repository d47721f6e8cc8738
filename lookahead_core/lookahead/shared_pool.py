"""The replica's shared n-gram pool: text of finished requests, offered as candidates to later ones."""
from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

from lookahead_core.lookahead.ngram_pool import NGramPool


class SharedNGramPool:
    """N-grams of finished requests (prompt and output), one `NGramPool` per n-gram size.

    A request fills the candidate slots its own pool leaves empty from here. Verification
    accepts only what the model itself would produce, so another request's text can make a
    request faster but never changes its tokens. Memory is bounded: at most `max_keys` first
    tokens per n, each with at most `cap` continuations. Only the last `tail` tokens of a text are
    added, so the work of adding stays bounded however long a prompt was.
    """

    def __init__(self, cap: int, max_keys: int, tail: int = 512) -> None:
        if cap < 1 or max_keys < 1 or tail < 2:
            raise ValueError(f"shared pool cap and max_keys must be >= 1 and tail >= 2, got {cap}, {max_keys}, {tail}")
        self.cap = cap
        self.max_keys = max_keys
        self.tail = tail
        self._pools: dict[int, NGramPool] = {}

    def __len__(self) -> int:
        return sum(len(p) for p in list(self._pools.values()))  # one copy: `track` may add a pool meanwhile

    def bytes_bound(self, sizes: Iterable[int], vocab_size: int) -> int:
        """The most this pool's Python objects can take with n-gram `sizes` tracked: every key
        (at most `max_keys`, at most the vocabulary) holding `cap` continuations of tokens that
        share no objects, sized on this interpreter."""
        keys = min(self.max_keys, vocab_size)
        token = sys.getsizeof(1 << 20)  # token ids above the interpreter's cached small ints
        index = sys.getsizeof(dict.fromkeys(range(keys))) + 8 * keys  # the table and its key order
        conts = sys.getsizeof(dict.fromkeys(range(self.cap)))
        total = 0
        for n in sizes:
            continuation = sys.getsizeof(tuple(range(n - 1))) + (n - 1) * token
            total += index + keys * (token + conts + self.cap * continuation)
        return total

    def track(self, n: int) -> None:
        """Start keeping n-grams of size n; requests finished before this are not in it."""
        if n not in self._pools:
            self._pools[n] = NGramPool(n, self.cap, self.max_keys)

    def add_text(self, tokens: Sequence[int]) -> None:
        """Add the n-grams of the last `tail` tokens of a finished request's text."""
        tokens = tokens[-self.tail :]
        for pool in self._pools.values():
            pool.add_sequence(tokens)

    def fill(self, n: int, key: int, candidates: list[tuple[int, ...]], g: int) -> None:
        """Append continuations of `key` not already in `candidates`, up to g in all."""
        pool = self._pools.get(n)
        if pool is None:
            return
        for cont in pool.lookup(key):
            if len(candidates) >= g:
                return
            if cont not in candidates:
                candidates.append(cont)

    def clear(self) -> None:
        for pool in self._pools.values():
            pool.clear()

"""Suffix lookups: the continuation of the last earlier match of a request's suffix, in its own text
(`SuffixIndex`) or in the replica's history of finished requests' text (`SharedHistory`)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

_GAP = -1  # between two texts in the ring: no continuation crosses it
_M64 = (1 << 64) - 1
_SEED = 0xCBF29CE484222325
_MUL = 0x9E3779B97F4A7C15  # odd: each fold step is a bijection of the 64-bit state
_EMPTY = -(1 << 62)  # a slot never written: older than any position, so always stale
_WINDOW = 32  # slots a key may sit in, from its home slot on


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


class SharedHistory:
    """A ring of the last `capacity` tokens of finished requests (prompt tail and output), with an
    index from each m-gram (m in `matches`) to where its latest continuation starts.

    A request whose own text offers no prompt-lookup candidate looks here: the longest of its
    suffixes (of `matches` lengths) seen before, extended backwards as far as it still matches,
    proposes what followed it, as long as the match (SuffixDecoding: a long match predicts a long
    run). What one request's text proposes to another changes its speed, never its tokens.

    The index is one hash table per m, allocated once: a power of two of at least 2 x `capacity`
    slots, each holding an m-gram's 64-bit hash and the position its continuation starts at. A key
    sits in one of the `_WINDOW` slots from its home slot; a new key takes the oldest of them, so an
    entry whose text was written over is reused, never deleted. A lookup checks the ring's tokens
    before the position it finds against the request's own: a hash collision, or text written over
    since, proposes nothing. A live entry is lost only where a new key finds its whole window live.
    """

    def __init__(self, capacity: int, matches: Sequence[int] = (8, 4, 2), max_extend: int = 32) -> None:
        if capacity < 2 or not matches or min(matches) < 1:
            raise ValueError(f"history needs capacity >= 2 and match lengths >= 1, got {capacity}, {matches}")
        self.capacity = capacity
        self.matches = tuple(sorted(set(matches), reverse=True))
        self.max_extend = max_extend
        self.ring = np.full(capacity, _GAP, dtype=np.int64)
        self.written = 0  # tokens ever written; position p lives at ring[p % capacity]
        bits = (2 * capacity - 1).bit_length()
        self._shift = 64 - bits  # a hash's top `bits` bits are its home slot
        self._window = min(_WINDOW, 1 << bits)
        slots = (1 << bits) + self._window - 1  # a window never wraps: the last home's runs into the padding
        self._hash = np.zeros((len(self.matches), slots), dtype=np.uint64)
        self._pos = np.full((len(self.matches), slots), _EMPTY, dtype=np.int64)
        self._mask = _M64  # the bits of a hash kept (tests narrow it to force collisions)
        self._views()

    def _views(self) -> None:
        """Views of the arrays, made again on a copy (a deep copy would make them arrays)."""
        # each slot's window as a row: a key's window is one contiguous gather
        self._hash_windows = sliding_window_view(self._hash.reshape(-1), self._window)
        self._pos_windows = sliding_window_view(self._pos.reshape(-1), self._window)
        # `propose` runs every step for every request: element reads through memoryviews are
        # Python ints, several times cheaper than numpy's scalar indexing
        self._ring_mv = self.ring.data
        self._hash_mv = [row.data for row in self._hash]
        self._pos_mv = [row.data for row in self._pos]

    def __getstate__(self) -> dict:
        views = ("_hash_windows", "_pos_windows", "_ring_mv", "_hash_mv", "_pos_mv")
        return {k: v for k, v in self.__dict__.items() if k not in views}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._views()

    def __len__(self) -> int:
        """Index entries whose m-gram is still in the ring (a pass over the tables, for /health)."""
        lo = self.written - self.capacity
        return sum(int(np.count_nonzero(self._pos[i] >= lo + m)) for i, m in enumerate(self.matches))

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes + self._hash.nbytes + self._pos.nbytes

    def add_text(self, tokens: Sequence[int]) -> None:
        """Append one finished text (its last `capacity - 1` tokens) and a gap after it."""
        text = np.asarray(tokens[-(self.capacity - 1):], dtype=np.int64).reshape(-1)
        n, w0 = len(text), self.written
        self.ring.put(np.arange(w0, w0 + n + 1), np.append(text, _GAP), mode="wrap")
        self.written = w0 + n + 1
        # the m-gram ending right before each position i of the text, hashed as `propose` does:
        # folded from t[i - 1] back to t[i - m], every m in one pass
        u = text.astype(np.uint64)
        gaps = np.flatnonzero(text == _GAP)
        mask, mul = np.uint64(self._mask), np.uint64(_MUL)
        h = np.full(n, _SEED, dtype=np.uint64)
        keys, starts, bases = [], [], []
        for j in range(1, self.matches[0] + 1):
            if j >= n:
                break
            h = (h[1:] ^ u[: n - j]) * mul  # h[k]: the j tokens before position k + j
            if j not in self.matches:
                continue
            i = self.matches.index(j)
            hm, at = h & mask, np.arange(j, n)
            if len(gaps):  # a gap token inside a text ends its m-grams, as the ring's own gaps do
                ok = np.searchsorted(gaps, at - j) == np.searchsorted(gaps, at, side="right")
                hm, at = hm[ok], at[ok]
            # the latest occurrence of each key wins
            _, last = np.unique(hm[::-1], return_index=True)
            last = len(hm) - 1 - last
            keys.append(hm[last])
            starts.append(at[last] + w0)
            bases.append((hm[last] >> np.uint64(self._shift)).astype(np.int64) + i * self._hash.shape[1])
        if keys:
            self._insert(np.concatenate(keys), np.concatenate(starts), np.concatenate(bases))

    def _insert(self, keys: np.ndarray, starts: np.ndarray, bases: np.ndarray) -> None:
        """Store each key's start in its window: in its own slot if there is one, else the oldest.
        Keys that pick the same slot go in rounds, one per slot a round."""
        hashes, positions = self._hash.reshape(-1), self._pos.reshape(-1)
        while len(keys):
            own = self._hash_windows[bases] == keys[:, None]
            pick = own.argmax(axis=1)
            none = ~own[np.arange(len(keys)), pick]
            pick[none] = self._pos_windows[bases[none]].argmin(axis=1)
            slot = bases + pick
            taken, first = np.unique(slot, return_index=True)
            hashes[taken] = keys[first]
            positions[taken] = starts[first]
            if len(first) == len(slot):
                return
            rest = np.ones(len(slot), dtype=bool)
            rest[first] = False
            keys, starts, bases = keys[rest], starts[rest], bases[rest]

    def propose(self, tokens: Sequence[int], max_len: int) -> tuple[int, ...]:
        """What followed the longest earlier match of the text's suffix: as many tokens as matched
        (at least 2, at most `max_len`), cut at the end of that text."""
        n = len(tokens)
        if max_len <= 0 or n < self.matches[-1]:
            return ()
        folded = [0]  # folded[j]: the hash of the last j tokens, folded from the end as `add_text` does
        h = _SEED
        for tok in map(int, reversed(tokens[-self.matches[0]:])):
            h = ((h ^ tok) * _MUL) & _M64
            folded.append(h)
        ring, cap, lo = self._ring_mv, self.capacity, self.written - self.capacity
        for i, m in enumerate(self.matches):
            if n < m:
                continue
            key = folded[m] & self._mask
            home = key >> self._shift
            window = self._hash_mv[i][home : home + self._window].tolist()
            if key not in window:
                continue
            starts = self._pos_mv[i]
            start = starts[home + window.index(key)]
            if window.count(key) > 1:  # only with a narrowed hash: the latest such entry
                start = max(starts[home + k] for k, x in enumerate(window) if x == key)
            # the ring's tokens before `start` must be the suffix's own (not a collision, not
            # written over); the match then extends backwards as far as they still agree
            matched, limit = 0, min(max(m, self.max_extend), n, start - lo)
            while matched < limit and ring[(start - matched - 1) % cap] == tokens[-matched - 1] != _GAP:
                matched += 1
            if matched < m:
                continue
            out = []
            for p in range(start, start + min(max_len, max(2, matched))):
                tok = ring[p % cap]
                if tok == _GAP:  # the ring's text ends in a gap, so `p` never reaches `written`
                    break
                out.append(tok)
            return tuple(out)
        return ()

    def clear(self) -> None:
        self.ring.fill(_GAP)
        self.written = 0
        self._hash.fill(0)
        self._pos.fill(_EMPTY)

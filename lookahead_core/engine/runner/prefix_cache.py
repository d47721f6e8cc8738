"""Prompt prefixes whose keys and values the replica already computed, reused across requests.

Every chat request starts with the chat template's system prompt, and a multi-turn conversation
resends its history: those positions' keys and values were computed before. Causal attention
makes the keys and values of positions [0, L) a function of tokens [0, L) alone, so a request
whose prompt starts with a stored prefix copies them into its KV slot and prefills only the rest
(vLLM's automatic prefix caching, SGLang's radix cache; here a few whole prefixes in a fixed
budget, matched by their longest common prefix with the prompt).

A prefix is copied in only the second time it is seen: most prompts come once, and copying each
would cost every admission its keys and values. Sightings are hashes of a prompt's prefixes at
every `min_match` tokens and at its end, a bounded set; a hash only picks what to copy, a match
always compares the token ids.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lookahead_core.engine.runner.kv_cache import BatchKVCache


@dataclass
class _Entry:
    tokens: np.ndarray                          # the prefix's token ids
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [heads, tokens, head_dim]


class PrefixCache:
    """At most `capacity_tokens` tokens of keys and values, in entries of one prompt prefix each
    (least recently used out, and none inside another). A prompt reuses the longest prefix it
    shares with an entry, from `min_match` tokens on. `max_seen` prefix hashes are remembered
    (about 120 bytes each), least recently seen out."""

    def __init__(self, capacity_tokens: int, min_match: int = 8, max_seen: int = 8192) -> None:
        self.capacity_tokens = capacity_tokens
        self.min_match = min_match
        self.max_seen = max_seen
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self.tokens = 0
        self.lookups = 0
        self.hits = 0
        self.prompt_tokens = 0  # prompt tokens looked up (each prompt but its last token)
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _longest(self, prompt: np.ndarray) -> tuple[int | None, int]:
        best, best_len = None, 0
        for key, entry in self._entries.items():
            n = min(len(entry.tokens), len(prompt))
            differ = np.flatnonzero(entry.tokens[:n] != prompt[:n])
            common = int(differ[0]) if len(differ) else n
            if common > best_len:
                best, best_len = key, common
        return best, best_len

    def match(self, prompt: Sequence[int]) -> int:
        """A lookup: the tokens of `prompt` a stored prefix holds (0: none, or fewer than `min_match`)."""
        self.lookups += 1
        self.prompt_tokens += len(prompt)
        _, length = self._longest(np.asarray(prompt, dtype=np.int64))
        return length if length >= self.min_match else 0

    def copy_in(self, prompt: Sequence[int], cache: BatchKVCache, slot: int, length: int) -> None:
        """Copy the first `length` tokens' keys and values of the stored prefix `match` found for
        `prompt` into `slot` at positions [0, length)."""
        key, common = self._longest(np.asarray(prompt, dtype=np.int64))
        if key is None or common < length:
            raise KeyError(f"no stored prefix holds the {length} tokens matched")
        entry = self._entries[key]
        self._entries.move_to_end(key)
        for layer, (k, v) in zip(cache.slot_layers, entry.kv, strict=True):
            layer.keys[slot, :, :length].copy_(k[:, :length])
            layer.values[slot, :, :length].copy_(v[:, :length])
        self.hits += 1
        self.reused_tokens += length

    def load(self, prompt: Sequence[int], cache: BatchKVCache, slot: int) -> int:
        """Copy the longest stored prefix of `prompt` into `slot` at positions [0, L); returns L (0: none)."""
        length = self.match(prompt)
        if length:
            self.copy_in(prompt, cache, slot, length)
        return length

    def store(self, prompt: Sequence[int], cache: BatchKVCache, slot: int) -> None:
        """Note the prefixes of `prompt` (all of it in `slot` from position 0) as seen, and keep the
        keys and values of the longest one seen before, unless an entry holds it already. Entries it
        holds go (an earlier turn of the same conversation); least recently used ones make room."""
        ids = np.asarray(prompt, dtype=np.int64)
        length = self._seen_before(ids)
        if length < self.min_match:
            return
        ids = ids[:length]
        inside = []
        for key, entry in self._entries.items():
            n = min(len(entry.tokens), length)
            if np.array_equal(entry.tokens[:n], ids[:n]):
                if n == length:  # held already
                    self._entries.move_to_end(key)
                    return
                inside.append(key)
        for key in inside:
            self.tokens -= len(self._entries.pop(key).tokens)
        while self._entries and self.tokens + length > self.capacity_tokens:
            _, old = self._entries.popitem(last=False)
            self.tokens -= len(old.tokens)
        kv = [(layer.keys[slot, :, :length].clone(), layer.values[slot, :, :length].clone())
              for layer in cache.slot_layers]
        self._entries[self._next] = _Entry(ids, kv)
        self._next += 1
        self.tokens += length

    def _seen_before(self, ids: np.ndarray) -> int:
        """The longest prefix of `ids` (at a multiple of `min_match` tokens or all of it, within
        the budget) whose hash was seen before; every one's is noted now."""
        step, end = self.min_match, min(len(ids), self.capacity_tokens)
        ends = list(range(step, end + 1, step)) + ([end] if end % step and end == len(ids) else [])
        h, start, longest = 0, 0, 0
        for stop in ends:
            h = hash((h, stop, ids[start:stop].tobytes()))
            start = stop
            if h in self._seen:
                longest = stop
                self._seen.move_to_end(h)
            else:
                self._seen[h] = None
        while len(self._seen) > self.max_seen:
            self._seen.popitem(last=False)
        return longest

    def clear(self) -> None:
        """Forget every entry and the counts (the replica's warm-up text is no one's)."""
        self._entries.clear()
        self._seen.clear()
        self.tokens = self.lookups = self.hits = self.prompt_tokens = self.reused_tokens = 0

    def status(self) -> dict:
        """Entries, tokens held and how much of the prompts looked up came from here (for /health)."""
        return {"entries": len(self._entries), "tokens": self.tokens, "capacity_tokens": self.capacity_tokens,
                "lookups": self.lookups, "hits": self.hits, "prompt_tokens": self.prompt_tokens,
                "reused_tokens": self.reused_tokens,
                "token_hit_rate": round(self.reused_tokens / self.prompt_tokens, 4) if self.prompt_tokens else None}

"""End-of-sequence, stop tokens and length limits applied inside an accepted block."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StopCondition:
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    eos_ids: frozenset[int] = frozenset()

    @classmethod
    def build(cls, max_new_tokens: int, eos_token_id: int | Iterable[int] | None, stop_token_ids: Iterable[int] = ()) -> StopCondition:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if eos_token_id is None:
            eos = frozenset()
        elif isinstance(eos_token_id, int):
            eos = frozenset([eos_token_id])
        else:
            eos = frozenset(int(t) for t in eos_token_id)
        stops = frozenset(int(t) for t in stop_token_ids) - eos
        return cls(max_new_tokens, stops, eos)

    def clip(self, tokens: list[int], produced: int) -> tuple[list[int], str | None]:
        """Cut an accepted block at the first stop token (kept) or at the length limit."""
        room = self.max_new_tokens - produced
        for i, tok in enumerate(tokens[:room]):
            if tok in self.eos_ids:
                return tokens[: i + 1], "eos"
            if tok in self.stop_ids:
                return tokens[: i + 1], "stop"
        if len(tokens) >= room:
            return tokens[:room], "length"
        return tokens, None

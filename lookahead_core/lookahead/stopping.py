"""How a sequence ends: end-of-sequence, stop tokens and the length limit, applied inside an accepted block."""
from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class FinishReason(enum.StrEnum):
    """Why a sequence ended. The engine produces EOS, STOP, LENGTH and ABORT; TIMEOUT comes from the
    async front, whose deadline aborts the request. A stop string also ends as STOP."""

    EOS = "eos"
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TIMEOUT = "timeout"


def check_max_new_tokens(value: object) -> int:
    """The one rule on a token budget: an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {value!r}")
    return value


def _ids(tokens: int | Iterable[int] | None) -> frozenset[int]:
    if tokens is None:
        return frozenset()
    if isinstance(tokens, int):
        return frozenset([tokens])
    return frozenset(int(t) for t in tokens)


@dataclass(frozen=True)
class StopCondition:
    """`eos_ids` end a sequence as EOS, `stop_ids` as STOP (both kept in the output); at most
    `max_new_tokens` are produced."""

    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    eos_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        check_max_new_tokens(self.max_new_tokens)
        object.__setattr__(self, "eos_ids", _ids(self.eos_ids))
        object.__setattr__(self, "stop_ids", _ids(self.stop_ids) - self.eos_ids)

    @classmethod
    def build(cls, max_new_tokens: int, eos_token_id: int | Iterable[int] | None,
              stop_token_ids: Iterable[int] = ()) -> StopCondition:
        return cls(max_new_tokens, _ids(stop_token_ids), _ids(eos_token_id))

    def clip(self, tokens: list[int], produced: int) -> tuple[list[int], FinishReason | None]:
        """Cut an accepted block at the first stop token (kept) or at the length limit."""
        room = self.max_new_tokens - produced
        for i, tok in enumerate(tokens[:room]):
            if tok in self.eos_ids:
                return tokens[: i + 1], FinishReason.EOS
            if tok in self.stop_ids:
                return tokens[: i + 1], FinishReason.STOP
        if len(tokens) >= room:
            return tokens[:room], FinishReason.LENGTH
        return tokens, None

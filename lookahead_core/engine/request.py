"""The one request type the engine takes: built once above it, checked once here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lookahead_core.engine.logprobs import check_top
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams
from lookahead_core.lookahead.stopping import StopCondition

Lookahead = LookaheadParams | Literal["auto", "off"]


def check_lookahead(value: object) -> None:
    if not (isinstance(value, LookaheadParams) or value in ("auto", "off")):
        raise ValueError(f"`lookahead` must be \"auto\", \"off\" or LookaheadParams, got {value!r}")


def check_sampling(value: object) -> None:
    if value is not None and not isinstance(value, SamplingParams):
        raise ValueError(f"`sampling` must be SamplingParams or None, got {type(value).__name__}")


@dataclass(frozen=True)
class EngineRequest:
    """One sequence to decode.

    lookahead: fixed (N, W, G), "off" (plain decoding) or "auto" (the engine's own setting, paced).
    sampling: None or temperature 0 is greedy. logprobs / prompt_logprobs: report each new / prompt
    token's log-probability with that many most likely alternatives (None: not at all).
    """

    request_id: str | int
    prompt: tuple[int, ...]
    stop: StopCondition
    lookahead: Lookahead = "auto"
    sampling: SamplingParams | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        prompt = self.prompt
        if isinstance(prompt, (str, bytes)) or any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise ValueError("the prompt must be a sequence of token ids")
        object.__setattr__(self, "prompt", tuple(int(t) for t in prompt))
        if not self.prompt:
            raise ValueError("the prompt must hold at least one token")
        if not isinstance(self.stop, StopCondition):
            raise TypeError(f"stop must be a StopCondition, got {type(self.stop).__name__}")
        check_lookahead(self.lookahead)
        check_sampling(self.sampling)
        check_top("logprobs", self.logprobs)
        check_top("prompt_logprobs", self.prompt_logprobs)

    @property
    def max_new_tokens(self) -> int:
        return self.stop.max_new_tokens

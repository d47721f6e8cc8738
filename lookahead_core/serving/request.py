"""The one request type of the serving path, built once from the HTTP body and checked once."""
from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from lookahead_core.engine.io import check_lookahead, check_sampling, check_top
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams
from lookahead_core.lookahead.stopping import check_max_new_tokens
from lookahead_core.serving.outputs import LookaheadMode, RequestError

PROMPT_FIELDS = ("prompt", "input_ids", "messages")
MAX_CHOICES = 16
# A request that names no token budget gets this many, or the engine's limit where that is lower.
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class Message:
    """One chat turn, rendered by the model's chat template."""

    role: str
    content: str

    def to_dict(self) -> dict:
        return {"role": self.role, "content": self.content}


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class ServeRequest:
    """One generation request: exactly one of `prompt` (text), `input_ids` or `messages` (chat).

    lookahead: "auto" (the engine's own (N, W, G), paced), "off", or fixed params.
    sampling: None is greedy decoding. timeout_s: the client's own deadline (the server may cap it).
    max_new_tokens: None is DEFAULT_MAX_NEW_TOKENS capped at the engine's limit and the context the prompt leaves.
    ignore_eos: decode past EOS up to max_new_tokens. logprobs: return each token's log-probability
    with that many alternatives (None: none). echo: the prompt comes first in the text (and in the
    logprobs). n: independent choices, decoded side by side (a seed gives choice i seed + i).
    Rules on (N, W, G) live in LookaheadParams, on sampling in SamplingParams, on the token budget
    in `check_max_new_tokens`, on logprobs in `check_top`, on the lookahead and sampling fields in
    `check_lookahead` / `check_sampling`; this class checks the prompt fields and raises
    RequestError (400) naming the field.
    """

    prompt: str | None = None
    input_ids: tuple[int, ...] | None = None
    messages: tuple[Message, ...] | None = None
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    lookahead: Literal["auto", "off"] | LookaheadParams = "auto"
    sampling: SamplingParams | None = None
    timeout_s: float | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    echo: bool = False
    n: int = 1
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        # Lists become tuples (the request is immutable); dict turns become Messages.
        if self.input_ids is not None:
            if any(isinstance(t, bool) or not isinstance(t, int) for t in self.input_ids):
                raise RequestError(400, "`input_ids` must be a list of integers", "input_ids")
            _set(self, "input_ids", tuple(self.input_ids))
        if self.messages is not None:
            turns = tuple(Message(**m) if isinstance(m, Mapping) else m for m in self.messages)
            if not all(isinstance(m, Message) and isinstance(m.content, str) for m in turns):
                raise RequestError(400, "`messages` must be chat turns {role, content}", "messages")
            _set(self, "messages", turns)
        given = [name for name in PROMPT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise RequestError(400, "give exactly one of `prompt` (a string), `input_ids` (a list of token ids) or "
                                    "`messages` (chat turns)")
        if not getattr(self, given[0]):
            raise RequestError(400, f"`{given[0]}` must not be empty", given[0])
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise RequestError(400, "`prompt` must be a string", "prompt")
        try:
            if self.max_new_tokens is not None:
                check_max_new_tokens(self.max_new_tokens)
        except ValueError as exc:
            raise RequestError(400, str(exc), "max_new_tokens") from None
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) for s in stop):
            raise RequestError(400, "`stop` must be a list of strings", "stop")
        _set(self, "stop", stop)
        for name, check in (("lookahead", check_lookahead), ("sampling", check_sampling)):
            try:
                check(getattr(self, name))
            except ValueError as exc:
                raise RequestError(400, str(exc), name) from None
        try:
            check_top("logprobs", self.logprobs)
        except ValueError as exc:
            raise RequestError(400, str(exc), "logprobs") from None
        if not isinstance(self.echo, bool):
            raise RequestError(400, f"`echo` must be a boolean, got {self.echo!r}", "echo")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_CHOICES:
            raise RequestError(400, f"`n` must be an integer in [1, {MAX_CHOICES}], got {self.n!r}", "n")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise RequestError(400, f"`timeout_s` must be > 0, got {self.timeout_s!r}", "timeout_s")

    @property
    def mode(self) -> LookaheadMode:
        if isinstance(self.lookahead, LookaheadParams):
            return "fixed"
        return self.lookahead  # type: ignore[return-value]

    @property
    def params(self) -> LookaheadParams | None:
        """The fixed (N, W, G), or None ("off", or "auto": the engine's own)."""
        return self.lookahead if isinstance(self.lookahead, LookaheadParams) else None

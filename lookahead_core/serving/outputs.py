"""What one served request produces: a text delta per engine step, then a completion, or an error."""
from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from lookahead_core.engine.io import SequenceStats
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.stopping import FinishReason
from lookahead_core.lookahead.tree import SOURCE_NAMES

LookaheadMode = Literal["auto", "off", "fixed"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Logprob:
    """One token as text with its log-probability under the model's raw distribution (before any
    sampling warp; None for a prompt's first token) and its most likely alternatives, best first."""

    token: str
    token_id: int
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """One call the model made, the `index`-th of its choice; `arguments`: the compact JSON text of an object."""

    name: str
    arguments: str
    index: int = 0
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))  # as OpenAI's look

    def openai(self) -> dict[str, Any]:
        """As in a message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self) -> dict[str, Any]:
        """As in a chat chunk's `delta.tool_calls`: the whole call in one piece."""
        return {"index": self.index, **self.openai()}


@dataclass(frozen=True)
class Delta:
    """One engine step's accepted tokens and the text they settled (possibly empty: held back).

    `index` is the choice it belongs to (a request with n > 1); `logprobs` has one entry per
    token when the request asked. With echo, the first Delta of a choice is the prompt itself.
    With tools, `text` is the content and `tool_calls` the calls the step completed."""

    token_ids: tuple[int, ...]
    text: str
    index: int = 0
    logprobs: tuple[Logprob, ...] | None = None
    usage: Usage | None = None  # of this choice so far
    tool_calls: tuple[ToolCall, ...] = ()

    def to_dict(self) -> dict:
        out: dict[str, object] = {"token_ids": list(self.token_ids), "text": self.text}
        if self.index:
            out["index"] = self.index
        return out


@dataclass(frozen=True)
class LookaheadSummary:
    """What a request ran: its (N, W, G) (for "auto": the engine's setting), its steps of each kind
    (plain, verify, full), their mean width in rows, the tokens each step bought, and per
    candidate source the tree rows it put in those steps and how many were accepted. All as the
    engine counted them: tokens a stop string cut from the text still count, their steps ran."""

    mode: LookaheadMode
    n: int | None
    w: int | None
    g: int | None
    steps: int
    compression: float | None  # tokens per decode step
    steps_by_kind: dict[str, int]
    mean_width: float | None  # step rows fed to the model per step
    sources: dict[str, dict[str, int]] = field(default_factory=dict)  # {source: {"proposed": rows, "accepted": rows}}

    @classmethod
    def of(cls, mode: LookaheadMode, params: LookaheadParams | None, stats: SequenceStats | None) -> LookaheadSummary:
        """The engine's count of the request (`SequenceStats`, on its last output). None where the
        request ended before the engine reported it (its deadline passed, a step failed after a
        stop string): no steps counted, compression and mean width null, no kinds or sources."""
        n, w, g = (params.n, params.w, params.g) if params is not None else (None, None, None)
        if stats is None or not stats.steps:
            return cls(mode, n, w, g, 0, None, {}, None, {})
        sources = {name: {"proposed": stats.proposed[name], "accepted": stats.accepted_from.get(name, 0)}
                   for name in SOURCE_NAMES if stats.proposed.get(name)}
        return cls(mode, n, w, g, stats.steps, round(stats.compression, 3), dict(stats.steps_by_kind),
                   round(stats.mean_width, 2), sources)

    def without(self, sources: Collection[str]) -> LookaheadSummary:
        """This summary with those sources' rows left out of `sources`."""
        return dataclasses.replace(self, sources={k: v for k, v in self.sources.items() if k not in sources})


# Candidates from other requests' text: whether they were accepted tells a client whether another
# tenant's recent text continued its prompt (docs/RELIABILITY.md).
REPLICA_TEXT_SOURCES = ("shared", "history")


@dataclass(frozen=True)
class Timings:
    ttft_ms: float
    total_ms: float


@dataclass(frozen=True)
class Completion:
    """The final item of a request: the whole text (stop string cut off) and how it ended; with tools, the content
    outside the calls and the calls."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    lookahead: LookaheadSummary
    timings: Timings
    index: int = 0
    logprobs: tuple[Logprob, ...] | None = None  # of `text`'s tokens (with echo: the prompt's first)
    tool_calls: tuple[ToolCall, ...] = ()

    def without_sources(self, sources: Collection[str]) -> Completion:
        return dataclasses.replace(self, lookahead=self.lookahead.without(sources))

    def to_dict(self) -> dict:
        out = asdict(self)
        out["token_ids"] = list(self.token_ids)
        out["finish_reason"] = str(self.finish_reason)
        del out["logprobs"], out["index"], out["tool_calls"]  # /generate takes no tools
        return out


class RequestError(ValueError):
    """A request the server refuses or could not finish: an HTTP status and a message for the client.

    `param` names the offending request field, `code` is a machine-readable reason and `type`
    overrides OpenAI's error type (otherwise derived from the status). A ValueError, so that
    code validating a request may raise it where a ValueError is expected."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def __reduce__(self):  # pickled across the Serve hop with every field
        return type(self), (self.status, self.message, self.param, self.code, self.type)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RequestError) and self.__reduce__() == other.__reduce__()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RequestError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"

"""The one request type of the serving path, built once from the HTTP body and checked once."""
from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from lookahead_core.constraints.grammar import GrammarSpec
from lookahead_core.constraints.logit_rules import LogitRules
from lookahead_core.engine.io import check_lookahead, check_sampling, check_top
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams
from lookahead_core.lookahead.stopping import check_max_new_tokens
from lookahead_core.serving.outputs import LookaheadMode, RequestError
from lookahead_core.serving.tools import ToolChoice, ToolSpec, tool_grammar

PROMPT_FIELDS = ("prompt", "input_ids", "messages")
MAX_CHOICES = 16
# A request that names no token budget gets this many, or the engine's limit where that is lower.
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class Message:
    """One chat turn, rendered by the model's chat template: `content` (None: an assistant's turn of calls alone), an
    assistant's `tool_calls` (OpenAI's dicts) or a tool's result for `tool_call_id`, as `tools.template_turns` reads them."""

    role: str
    content: str | None
    tool_calls: tuple[dict[str, Any], ...] = field(default=(), hash=False)
    tool_call_id: str | None = None

    def __post_init__(self) -> None:
        _set(self, "tool_calls", tuple(self.tool_calls or ()))

    def to_dict(self) -> dict:
        calls = {"tool_calls": list(self.tool_calls)} if self.tool_calls else {}
        result = {"tool_call_id": self.tool_call_id} if self.tool_call_id is not None else {}
        return {"role": self.role, "content": self.content, **calls, **result}


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
    rules: penalties, logit bias, min_tokens (None where all are neutral). grammar: what the output
    must match, given in the HTTP field `grammar_field` (its errors name it). stop_token_ids: tokens
    that end a choice as "stop" (kept in its token ids, left out of its text). tools: the functions a chat may
    call, as `tool_choice` allows; a forced choice's grammar is `tool_grammar`'s (field "tool_choice"), alone.
    Rules on (N, W, G) live in LookaheadParams, on sampling in SamplingParams, on the token budget
    in `check_max_new_tokens`, on logprobs in `check_top`, on the lookahead and sampling fields in
    `check_lookahead` / `check_sampling`, on the logits options in LogitRules, on a grammar's text in
    GrammarSpec; this class checks the prompt fields and the fields' types and pairings, and raises
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
    rules: LogitRules | None = None
    grammar: GrammarSpec | None = None
    grammar_field: str = "grammar"
    stop_token_ids: tuple[int, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        # Lists become tuples (the request is immutable); dict turns become Messages.
        if self.input_ids is not None:
            if any(isinstance(t, bool) or not isinstance(t, int) for t in self.input_ids):
                raise RequestError(400, "`input_ids` must be a list of integers", "input_ids")
            _set(self, "input_ids", tuple(self.input_ids))
        if self.messages is not None:
            turns = tuple(Message(**m) if isinstance(m, Mapping) else m for m in self.messages)
            if not all(isinstance(m, Message) and isinstance(m.content, (str, type(None))) for m in turns):
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
        self._check_options()

    def _check_options(self) -> None:
        """The logits options, the grammar and the stop token ids: their types and pairings."""
        if self.rules is not None and not isinstance(self.rules, LogitRules):
            raise RequestError(400, f"`rules` must be LogitRules or None, got {type(self.rules).__name__}", "rules")
        if self.rules is not None and not self.rules.active:
            _set(self, "rules", None)  # all neutral: the engine keeps its unconstrained path
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise RequestError(400, f"`{self.grammar_field}` must be a GrammarSpec or None, got "
                                    f"{type(self.grammar).__name__}", self.grammar_field)
        self._check_tools()
        if self.grammar is not None:
            if self.ignore_eos:  # a grammar that is done has nothing left to take but the end
                raise RequestError(400, f"`ignore_eos` cannot be combined with `{self.grammar_field}`: once the "
                                        "output matches, it can only end", "ignore_eos")
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in ids):
            raise RequestError(400, f"`stop_token_ids` must be a list of token ids (integers >= 0), got {ids!r}",
                               "stop_token_ids")
        _set(self, "stop_token_ids", tuple(ids))

    def _check_tools(self) -> None:
        """Tools are for a chat, the choice offers one of them unless "none"; a forced choice takes `tool_grammar`,
        no other grammar beside it (derived once: dataclasses.replace runs this again)."""
        tools, choice = tuple(self.tools or ()), self.tool_choice
        if not all(isinstance(t, ToolSpec) for t in tools) or (tools and self.messages is None):
            raise RequestError(400, "`tools` must be ToolSpecs, for a chat (`messages`)", "tools")
        if not isinstance(choice, ToolChoice) or (choice.mode != "none" and not choice.offered(tools)):
            raise RequestError(400, f"`tool_choice` {choice!r} offers none of `tools`", "tool_choice")
        _set(self, "tools", tools)
        if not choice.forced or self.grammar_field == "tool_choice":
            return
        if self.grammar is not None:
            raise RequestError(400, f"a forced `tool_choice` ({choice.name or choice.mode}) cannot be combined with "
                                    f"`{self.grammar_field}`: the calls follow their own grammar", "tool_choice")
        _set(self, "grammar", tool_grammar(tools, choice))
        _set(self, "grammar_field", "tool_choice")

    @property
    def mode(self) -> LookaheadMode:
        if isinstance(self.lookahead, LookaheadParams):
            return "fixed"
        return self.lookahead  # type: ignore[return-value]

    @property
    def params(self) -> LookaheadParams | None:
        """The fixed (N, W, G), or None ("off", or "auto": the engine's own)."""
        return self.lookahead if isinstance(self.lookahead, LookaheadParams) else None

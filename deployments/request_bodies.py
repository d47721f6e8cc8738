"""HTTP request bodies, native and OpenAI: pydantic checks their shapes (a 4xx before anything
reaches a replica) and `to_request` turns each into the one ServeRequest, refusing with RequestError
what shapes cannot say. deployments.bounded_bodies bounds them by the server's limits; their logits
options and structured output are deployments.option_bodies'."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, WithJsonSchema, field_validator
from pydantic.config import JsonDict

from lookahead_core.constraints.grammar import GrammarSpec
from lookahead_core.engine.io import MAX_TOP_LOGPROBS
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams
from lookahead_core.serving import Message, RequestError, ServeRequest
from lookahead_core.serving.request import DEFAULT_MAX_NEW_TOKENS, MAX_CHOICES, PROMPT_FIELDS

from .option_bodies import FORMAT_ALONE, GRAMMAR_ALONE, LogitsOptions, ResponseFormat, TokenId, ToolTurn, openai_grammars, tool_options


def parse_lookahead(value):
    """"auto", "off" or {"n", "w", "g"[, "adapt"]} (checked by LookaheadParams), with one clear
    message otherwise."""
    if isinstance(value, str):
        if value not in ("auto", "off"):
            raise ValueError(f"must be \"auto\", \"off\" or {{\"n\": .., \"w\": .., \"g\": ..}}, got {value!r}")
        return value
    if isinstance(value, dict):
        if not {"n", "w", "g"} <= set(value) <= {"n", "w", "g", "adapt"}:
            raise ValueError(f"takes exactly the keys n, w, g (and optionally adapt), got {sorted(value)}")
        # JSON has one number type: 3.0 is the integer 3 (JSON Schema's reading, and pydantic's for int fields)
        n, w, g = (int(v) if isinstance(v, float) and v.is_integer() else v for v in (value["n"], value["w"], value["g"]))
        return LookaheadParams(n, w, g, adapt=value.get("adapt", True))
    if isinstance(value, LookaheadParams):
        return value
    raise ValueError(f"must be \"auto\", \"off\" or an object with n, w, g, got {type(value).__name__}")


def lookahead_schema(maximum: dict[str, int] | None = None) -> JsonDict:
    """The `lookahead` field's schema: LookaheadParams' bounds (which LookaheadParams enforces) and
    an engine's largest n, w, g where given."""
    nwg: JsonDict = {k: {"type": "integer", "minimum": LookaheadParams.MINIMUM[k], **({"maximum": maximum[k]} if maximum else {})}
                     for k in ("n", "w", "g")}
    adapt: JsonDict = {"type": "boolean", "default": True, "description": "narrow steps that do not pay (false: every step whole)"}
    return {"anyOf": [{"enum": ["auto", "off"], "type": "string"},
                      {"type": "object", "additionalProperties": False, "required": ["n", "w", "g"],
                       "properties": {**nwg, "adapt": adapt}}],
            "description": "\"auto\" (the engine's own (N, W, G), each step as wide as pays), \"off\", "
                           "or a fixed (N, W, G)"}


Lookahead = Annotated[Literal["auto", "off"] | LookaheadParams, BeforeValidator(parse_lookahead),
                      WithJsonSchema(lookahead_schema())]


class _Common(LogitsOptions):
    """Fields every route shares. Sampling: temperature 0 or absent is greedy; top_k 0, top_p 1 and
    min_p 0 are off; in float32 a seed makes a request's text reproducible, in bf16 only for the same
    step shapes (GET /health `seeded_text`; the bounds are SamplingParams'). The logits options,
    stop_token_ids and structured_outputs: LogitsOptions."""

    lookahead: Lookahead = "auto"
    timeout_s: float | None = Field(
        None, gt=0, le=86400, description="end the request after this many seconds (capped by the server's limit)"
    )
    # json_schema_extra documents SamplingParams' bounds in the OpenAPI schema; SamplingParams checks them.
    top_k: int = Field(0, json_schema_extra={"minimum": 0})
    top_p: float = Field(1.0, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    seed: int | None = Field(None, description="fixes the sampled text in float32 whatever runs beside it; in bf16 "
                                               "only for the same step shapes (GET /health seeded_text)",
                             json_schema_extra={"minimum": 0})
    min_p: float | None = Field(None, description="drop tokens less likely than min_p times the likeliest (sampling only)",
                                json_schema_extra={"minimum": 0, "maximum": 1})
    # A refusal's status on this body's route: OpenAI's and vLLM's 400, FastAPI's 422 on /generate.
    REFUSAL_STATUS: ClassVar[int] = 400
    if TYPE_CHECKING:  # every route declares it, with its own default and bounds
        temperature: float | None

    @field_validator("temperature", "top_k", "top_p", "seed", "min_p", check_fields=False)
    @classmethod
    def _sampling_field(cls, value, info):
        if value is not None:
            SamplingParams(**{info.field_name: value})
        return value

    def sampling(self) -> SamplingParams | None:
        params = SamplingParams(self.temperature or 0.0, self.top_k, self.top_p, self.seed, self.min_p or 0.0)
        return None if params.greedy else params

    def _check(self) -> None:
        """Refuse (RequestError) what a field's type cannot: fields that need each other, options not served."""

    def _serve_request(self) -> ServeRequest:
        raise NotImplementedError

    def to_request(self) -> ServeRequest:
        """The one request this body asks for (a new request id each call); raises RequestError with
        REFUSAL_STATUS, naming the field, for what the body's shape allows but the server does not
        serve (ServeRequest's rules on the prompt fields, fields that need each other)."""
        try:
            self._check()
            return self._serve_request()
        except RequestError as err:
            if err.status == self.REFUSAL_STATUS:
                raise
            raise RequestError(self.REFUSAL_STATUS, err.message, err.param, err.code, err.type) from None


class ChatMessage(ToolTurn):
    """One chat turn; `content` is a string or a list of text parts, as the OpenAI API allows, or null."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value):
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part of type {kind!r} is not supported: only {{\"type\": \"text\", \"text\": ...}}")
            texts.append(part["text"])
        return "".join(texts)


def _messages(messages: list[ChatMessage] | None) -> tuple[Message, ...] | None:
    return None if messages is None else tuple(Message(m.role, m.content, **m.tool_fields()) for m in messages)


# The schema states the rules ServeRequest enforces on prompts, so that a body valid by the schema
# is one the server serves (the fuzz test holds it to that): exactly one prompt field, none empty.
# Server limits (token ids within the vocabulary, token budget, stop strings, model id) are
# deployments.bounded_bodies'.
# `required` alone would let {"prompt": null} through: a given field is a non-null one.
_ONE_PROMPT: JsonDict = {"oneOf": [{"required": [name], "properties": {name: {"not": {"type": "null"}}}}
                                   for name in PROMPT_FIELDS]}


class GenerateRequest(_Common):
    model_config = ConfigDict(extra="forbid", json_schema_extra={**_ONE_PROMPT, "dependentSchemas": GRAMMAR_ALONE})
    REFUSAL_STATUS: ClassVar[int] = 422
    temperature: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": SamplingParams.MAX_TEMPERATURE})
    # minLength / minItems bind only strings / arrays, so they sit beside the null branch
    prompt: str | None = Field(None, json_schema_extra={"minLength": 1})
    input_ids: list[TokenId] | None = Field(None, json_schema_extra={"minItems": 1})
    messages: list[ChatMessage] | None = Field(None, description="chat turns, formatted by the model's chat template",
                                               json_schema_extra={"minItems": 1})
    max_new_tokens: int | None = Field(None, description=f"default: {DEFAULT_MAX_NEW_TOKENS}, or less where the server's "
                                                         "limit or the context left after the prompt is lower",
                                       json_schema_extra={"minimum": 1})  # the rule: stopping.check_max_new_tokens
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    ignore_eos: bool = Field(False, description="decode past EOS up to max_new_tokens")

    def _serve_request(self) -> ServeRequest:
        input_ids = None if self.input_ids is None else tuple(self.input_ids)
        return ServeRequest(prompt=self.prompt, input_ids=input_ids, messages=_messages(self.messages),
                            max_new_tokens=self.max_new_tokens, stop=tuple(self.stop), lookahead=self.lookahead,
                            sampling=self.sampling(), timeout_s=self.timeout_s, ignore_eos=self.ignore_eos,
                            **self.options())


# OpenAI request fields this server does not implement, each with its one "not used" value
# besides null, false and empty. Any other value is refused with 400 naming the field: a client
# must never believe it got functions or a prediction it did not get. (`user` only identifies the
# end user: it is a declared field, accepted and ignored. Other fields nobody declared are ignored, as in vLLM.)
UNSUPPORTED: dict[str, object] = {
    "functions": None, "function_call": "none",  # OpenAI's deprecated forms of tools
    "best_of": 1, "suffix": None, "audio": None, "modalities": ["text"], "prediction": None,
}


def _is_off(value, off) -> bool:
    if value is None or value is False or (isinstance(value, (str, list, dict)) and not value):
        return True
    return not isinstance(value, bool) and value == off  # logprobs=0 and True are not "off"


class StreamOptions(BaseModel):
    """`continuous_usage_stats` (a vLLM extension, which GuideLLM sends): every chunk carries the
    usage so far."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAIRequest(_Common):
    """Fields shared by the OpenAI endpoints (OpenAI's defaults: temperature 1, at most 2). `top_k`,
    `lookahead`, `timeout_s` and `ignore_eos` (as in vLLM: decode past EOS up to the token limit) are extensions."""

    model_config = ConfigDict(extra="allow")  # kept for the UNSUPPORTED check, else unused
    model: str | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(1.0, le=2, json_schema_extra={"minimum": 0})
    ignore_eos: bool = False
    user: str | None = None  # an end-user identifier: accepted and ignored
    response_format: ResponseFormat | None = Field(None, description="text, any JSON object, or JSON matching a schema")

    _unsupported: ClassVar[dict[str, object]] = UNSUPPORTED
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="independent choices (a seed gives choice i seed + i)")

    def _check(self) -> None:
        extra = self.model_extra or {}
        for field, off in self._unsupported.items():
            if not _is_off(extra.get(field), off):
                also = "" if off is None else f" (other than {json.dumps(off)})"
                raise RequestError(400, f"`{field}`{also} is not supported by this server", field, "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise RequestError(400, "`stream_options` is only allowed when `stream` is true", "stream_options")

    def _grammars(self) -> dict[str, GrammarSpec]:
        return {**openai_grammars(self.response_format, self.model_extra or {}), **super()._grammars()}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def _openai_request(self, token_limit: int | None, logprobs: int | None, echo: bool = False, **given) -> ServeRequest:
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return ServeRequest(**given, max_new_tokens=token_limit, stop=stop, lookahead=self.lookahead,
                            sampling=self.sampling(), timeout_s=self.timeout_s, ignore_eos=self.ignore_eos,
                            logprobs=logprobs, echo=echo, n=self.n, **self.options())


_Id = TypeVar("_Id")
CompletionPrompt = str | list[str] | list[_Id] | list[list[_Id]]  # given the token id type


def completion_prompt_schema(token_id: Any) -> JsonDict:
    """What `prompt` takes: one non-empty string or list of `token_id`s, alone or in a list of one."""
    ids: JsonDict = {"type": "array", "items": TypeAdapter(token_id).json_schema(), "minItems": 1}
    return {"anyOf": [{"type": "string", "minLength": 1}, ids,
                      {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
                      {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}],
            "title": "Prompt", "description": "a string or token ids, or a list of one of either (one prompt per request)"}


# OpenAI's pairings, refused with 400 when broken: stream_options needs stream, top_logprobs logprobs.
_NEEDS_STREAM: JsonDict = {"stream_options": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
_NEEDS_LOGPROBS: JsonDict = {"top_logprobs": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}


class CompletionRequest(_OpenAIRequest):
    """`prompt`: a string, token ids, or a list of one of either (one prompt per request)."""

    model_config = ConfigDict(json_schema_extra={"dependentSchemas": {**_NEEDS_STREAM, **GRAMMAR_ALONE, **FORMAT_ALONE}})
    _unsupported: ClassVar[dict[str, object]] = {**UNSUPPORTED, "tools": None, "tool_choice": "none"}  # a chat's alone
    prompt: Annotated[CompletionPrompt[TokenId], WithJsonSchema(completion_prompt_schema(TokenId))]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5, description="log-probabilities of each token and this many alternatives")
    echo: bool = Field(False, description="the prompt first in the text (and, with logprobs, the prompt's logprobs)")

    def _serve_request(self) -> ServeRequest:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise RequestError(400, "batched prompts are not supported: send one prompt per request", "prompt")
            prompt = prompt[0]
        given = {"prompt": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
        return self._openai_request(self.max_tokens or 16, self.logprobs, self.echo, **given)  # OpenAI's default, also for null


class ChatRequest(_OpenAIRequest):
    model_config = ConfigDict(json_schema_extra={"dependentSchemas": {**_NEEDS_STREAM, **_NEEDS_LOGPROBS, **GRAMMAR_ALONE,
                                                                      **FORMAT_ALONE}})
    _unsupported: ClassVar[dict[str, object]] = {**UNSUPPORTED, "echo": None}
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI: `max_completion_tokens`")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="log-probabilities of the output tokens")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per token; needs logprobs")

    def _check(self) -> None:
        super()._check()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError(400, "`top_logprobs` needs `logprobs: true`", "top_logprobs")

    def _serve_request(self) -> ServeRequest:
        limit = self.max_completion_tokens or self.max_tokens  # None: the server's default
        return self._openai_request(limit, (self.top_logprobs or 0) if self.logprobs else None,
                                    messages=_messages(self.messages), **tool_options(self.model_extra or {}))

"""The request bodies' logits options and structured output (vLLM's and OpenAI's fields), and their
one conversion into ServeRequest's `rules`, `grammar` (with the field it came from) and
`stop_token_ids`. The bounds are LogitRules' and GrammarSpec's: the schema states them, they check.
A chat's tools: `tool_options`, and the calls its turns send back."""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator
from pydantic.config import JsonDict

from lookahead_core.constraints.grammar import MAX_GRAMMAR_CHARS, GrammarSpec
from lookahead_core.constraints.logit_rules import (
    MAX_BIAS,
    MAX_BIASED_TOKENS,
    MAX_MIN_TOKENS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    LogitRules,
)
from lookahead_core.serving import RequestError
from lookahead_core.serving.tools import parse_tool_choice, parse_tools

TokenId = Annotated[int, Field(ge=0)]
# OpenAI's logit_bias: token ids as JSON keys, in decimal
TOKEN_KEY = re.compile(r"[0-9]+", re.ASCII)


def token_bias(value: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """logit_bias' (token id, bias) pairs; ValueError for a key that is not a token id (LogitRules checks the rest)."""
    bad = next((key for key in value if not TOKEN_KEY.fullmatch(key)), None)
    if bad is not None:
        raise ValueError(f"logit_bias keys must be token ids (decimal integers >= 0), got {bad!r}")
    return tuple((int(key), bias) for key, bias in value.items())


def logit_bias_schema(key_pattern: str = f"^{TOKEN_KEY.pattern}$") -> JsonDict:
    """The `logit_bias` field's schema: LogitRules' bounds, and token-id keys matching `key_pattern`."""
    biases: JsonDict = {"type": "object", "propertyNames": {"pattern": key_pattern}, "maxProperties": MAX_BIASED_TOKENS,
                        "additionalProperties": {"type": "number", "minimum": -MAX_BIAS, "maximum": MAX_BIAS}}
    return {"anyOf": [biases, {"type": "null"}],
            "description": "added to the logits of the tokens named (token id: bias), as in OpenAI's API"}


LogitBias = Annotated[dict[str, float] | None, WithJsonSchema(logit_bias_schema())]
# `structured_outputs` names exactly one grammar, a non-null one
GRAMMAR_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_ONE_GRAMMAR: JsonDict = {"oneOf": [{"required": [key], "properties": {key: {"not": {"type": "null"}}}} for key in GRAMMAR_KEYS]}
# vLLM's older spelling of structured_outputs, which clients written for vLLM before 0.11 send:
# each field is structured_outputs with the one key.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# The pairings `options` and ServeRequest refuse (400), stated for the bodies' schemas: one field at
# most asks for a grammar (response_format "text" asks for none), and a grammar refuses ignore_eos.
_NO_IGNORE_EOS: JsonDict = {"properties": {"ignore_eos": {"const": False}}}
_TEXT_FORMAT: JsonDict = {"properties": {"response_format": {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]}}}
GRAMMAR_ALONE: JsonDict = {"structured_outputs": {"anyOf": [{"properties": {"structured_outputs": {"type": "null"}}},
                                                            {"allOf": [_NO_IGNORE_EOS, _TEXT_FORMAT]}]}}
FORMAT_ALONE: JsonDict = {"response_format": {"anyOf": [_TEXT_FORMAT, _NO_IGNORE_EOS]}}


class StructuredOutputs(BaseModel):
    """What the output must match (vLLM's `structured_outputs`): exactly one of `json` (a JSON schema,
    or its JSON text), `regex`, `choice` (one of these strings), `grammar` (Lark or GBNF) and
    `json_object` (any JSON object). GrammarSpec checks each; the server checks it against its tokenizer."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, json_schema_extra=_ONE_GRAMMAR)
    json_: dict[str, Any] | str | None = Field(None, alias="json", json_schema_extra={"maxLength": MAX_GRAMMAR_CHARS})
    regex: str | None = Field(None, json_schema_extra={"minLength": 1, "maxLength": MAX_GRAMMAR_CHARS})
    choice: list[str] | None = Field(None, json_schema_extra={"minItems": 1})
    grammar: str | None = Field(None, json_schema_extra={"minLength": 1, "maxLength": MAX_GRAMMAR_CHARS})
    json_object: Literal[True] | None = None

    def spec(self, field: str) -> GrammarSpec:
        """The grammar asked for; RequestError (400) naming `field` where none or several are, or its text is refused."""
        given = [key for key, value in zip(GRAMMAR_KEYS, (self.json_, self.regex, self.choice, self.grammar,
                                                          self.json_object), strict=True) if value is not None]
        if len(given) != 1:
            raise RequestError(400, f"`{field}` takes exactly one of {', '.join(GRAMMAR_KEYS)}, got "
                                    f"{', '.join(given) or 'none'}", field)
        try:
            if self.json_ is not None:
                return GrammarSpec.json_schema(self.json_)
            if self.choice is not None:
                return GrammarSpec.choice(self.choice)
            if self.regex is not None:
                return GrammarSpec("regex", self.regex)
            if self.grammar is not None:
                return GrammarSpec("grammar", self.grammar)
            return GrammarSpec("json_object")
        except ValueError as exc:
            raise RequestError(400, f"`{field}`: {exc}", field) from None


class TextFormat(BaseModel):
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    type: Literal["json_object"]


class JsonSchema(BaseModel):
    """OpenAI's `json_schema`: the output matches `schema` (strict or not: the server always holds it to it)."""

    model_config = ConfigDict(validate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


def openai_grammars(response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None,
                    extra: dict[str, Any]) -> dict[str, GrammarSpec]:
    """The grammars OpenAI's `response_format` and vLLM's `guided_*` fields (in `extra`) ask for, by field."""
    asked = {}
    if isinstance(response_format, JsonObjectFormat):
        asked["response_format"] = GrammarSpec("json_object")
    elif isinstance(response_format, JsonSchemaFormat):
        try:
            asked["response_format"] = GrammarSpec.json_schema(response_format.json_schema.schema_)
        except ValueError as exc:
            raise RequestError(400, f"`response_format`: {exc}", "response_format") from None
    for name, key in GUIDED.items():
        if extra.get(name) is not None:
            try:
                asked[name] = StructuredOutputs.model_validate({key: extra[name]}).spec(name)
            except ValidationError as exc:
                raise RequestError(400, f"`{name}`: {exc.errors()[0]['msg']}", name) from None
    return asked


class LogitsOptions(BaseModel):
    """vLLM's logits options, stop token ids and structured output, on every route (absent or null:
    neutral). json_schema_extra states LogitRules' bounds in the OpenAPI schema; LogitRules checks them."""

    repetition_penalty: float | None = Field(None, description="HF's, over the prompt's and the output's tokens (1: off)",
                                             json_schema_extra={"exclusiveMinimum": 0, "maximum": MAX_REPETITION_PENALTY})
    presence_penalty: float | None = Field(None, description="subtracted once from each token the output holds",
                                           json_schema_extra={"minimum": -MAX_PENALTY, "maximum": MAX_PENALTY})
    frequency_penalty: float | None = Field(None, description="subtracted per occurrence in the output",
                                            json_schema_extra={"minimum": -MAX_PENALTY, "maximum": MAX_PENALTY})
    logit_bias: LogitBias = None
    min_tokens: int | None = Field(None, description="no end token (EOS, stop_token_ids) nor stop string before this "
                                                     "many new tokens", json_schema_extra={"minimum": 0, "maximum": MAX_MIN_TOKENS})
    stop_token_ids: list[TokenId] | None = Field(None, description="tokens that end the output as \"stop\" (kept in "
                                                                  "its token ids, not in its text)")
    structured_outputs: StructuredOutputs | None = Field(None, description="what the output must match")

    @field_validator("repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens")
    @classmethod
    def _rules_field(cls, value, info):
        if value is not None:
            LogitRules(**{info.field_name: value})
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        if value:
            LogitRules(logit_bias=token_bias(value))
        return value

    def rules(self) -> LogitRules:
        def given(value, neutral):
            return neutral if value is None else value
        return LogitRules(given(self.repetition_penalty, 1.0), given(self.presence_penalty, 0.0),
                          given(self.frequency_penalty, 0.0), token_bias(self.logit_bias or {}), given(self.min_tokens, 0))

    def _grammars(self) -> dict[str, GrammarSpec]:
        """Each field that asks for a grammar, with its grammar."""
        s = self.structured_outputs
        return {} if s is None else {"structured_outputs": s.spec("structured_outputs")}

    def options(self) -> dict[str, Any]:
        """ServeRequest's logits options, grammar (at most one field may ask for one) and stop token ids:
        the one conversion of every body."""
        asked = self._grammars()
        if len(asked) > 1:
            names = list(asked)
            raise RequestError(400, f"give at most one of {', '.join(f'`{n}`' for n in names)}", names[-1])
        field, grammar = next(iter(asked.items()), ("grammar", None))
        return {"rules": self.rules(), "grammar": grammar, "grammar_field": field,
                "stop_token_ids": tuple(self.stop_token_ids or ())}


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class MessageToolCall(BaseModel):
    """A call an assistant's turn made, as OpenAI's answer gave it, sent back with the chat."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


# Calls are an assistant's (tools.template_turns refuses them on other turns), stated for the schema.
_CALLS_ARE_THE_ASSISTANTS: JsonDict = {"tool_calls": {"anyOf": [{"properties": {"tool_calls": {"type": "null"}}},
                                                                 {"properties": {"role": {"const": "assistant"}}}]}}


class ToolTurn(BaseModel):
    """A chat turn's part in tool use: an assistant's `tool_calls`, sent back as OpenAI's answer gave them, or a tool's
    result for `tool_call_id`."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={"dependentSchemas": _CALLS_ARE_THE_ASSISTANTS})
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def tool_fields(self) -> dict[str, Any]:
        """Message's tool fields."""
        return {"tool_calls": tuple(c.model_dump() for c in self.tool_calls or ()), "tool_call_id": self.tool_call_id}


def tool_options(extra: dict[str, Any]) -> dict[str, Any]:
    """ServeRequest's `tools` and `tool_choice` from a chat body's fields as sent (`parse_tools` checks OpenAI's shapes,
    400s naming the field). Not declared: the OpenAPI schema would have fuzzers send tools whose prompt no small
    test server holds."""
    tools = parse_tools(extra.get("tools"))
    return {"tools": tools, "tool_choice": parse_tool_choice(extra.get("tool_choice"), tools)}

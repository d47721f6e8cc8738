"""HTTP request bodies; anything malformed is a 4xx with a message before it reaches a replica."""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from lookahead_core.params import LookaheadParams


class LookaheadSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = Field(ge=2)
    w: int = Field(ge=1)
    g: int = Field(ge=0)


def parse_lookahead(value):
    """"auto", "off" or {"n", "w", "g"}, with one clear message when it is none of them."""
    if isinstance(value, str):
        if value not in ("auto", "off"):
            raise ValueError(f"must be \"auto\", \"off\" or {{\"n\": .., \"w\": .., \"g\": ..}}, got {value!r}")
        return value
    if isinstance(value, dict):
        unknown = set(value) - {"n", "w", "g"}
        if unknown or set(value) != {"n", "w", "g"}:
            raise ValueError(f"takes exactly the keys n, w, g, got {sorted(value)}")
        LookaheadParams(value["n"], value["w"], value["g"])
        return LookaheadSpec(**value)
    if isinstance(value, LookaheadSpec):
        return value
    raise ValueError(f"must be \"auto\", \"off\" or an object with n, w, g, got {type(value).__name__}")


class _WithLookahead(BaseModel):
    lookahead: Literal["auto", "off"] | LookaheadSpec = "auto"
    timeout_s: float | None = Field(
        None, gt=0, le=86400, description="end the request after this many seconds (capped by the server's limit)"
    )

    @field_validator("lookahead", mode="before")
    @classmethod
    def _lookahead(cls, value):
        return parse_lookahead(value)


class _Sampling(BaseModel):
    """temperature 0 or absent is greedy; top_k 0 and top_p 1 are off; a seed makes a request reproducible."""

    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0)

    def sampling(self) -> dict:
        return {"temperature": self.temperature or 0.0, "top_k": self.top_k, "top_p": self.top_p, "seed": self.seed}


class ChatMessage(BaseModel):
    """One chat turn; `content` is a string or a list of text parts, as the OpenAI API allows."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str

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


class GenerateRequest(_WithLookahead, _Sampling):
    model_config = ConfigDict(extra="forbid")
    temperature: float | None = Field(None, ge=0, le=100)
    prompt: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = Field(None, description="chat turns, formatted by the model's chat template")
    max_new_tokens: int = Field(128, ge=1)
    stop: list[str] = Field(default_factory=list)
    stream: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        given = [x is not None for x in (self.prompt, self.input_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of `prompt` (a string), `input_ids` (a list of token ids) or "
                             "`messages` (chat turns)")
        if self.prompt is not None and not self.prompt:
            raise ValueError("`prompt` must not be empty")
        if self.input_ids is not None and not self.input_ids:
            raise ValueError("`input_ids` must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("`messages` must not be empty")
        return self


# OpenAI request fields this server does not implement, each with its one "not used" value
# besides null, false and empty. Any other value is refused with 400 naming the field: a client
# must never believe it got tools, logprobs or penalties it did not get. (`user` only identifies the
# end user: it is a declared field, accepted and ignored. Fields nobody declared are ignored, as in vLLM.)
UNSUPPORTED: dict[str, object] = {
    "tools": None, "tool_choice": "none", "functions": None, "function_call": "none",
    "response_format": {"type": "text"}, "logit_bias": None, "logprobs": None, "top_logprobs": 0,
    "echo": None, "best_of": 1, "suffix": None, "presence_penalty": 0, "frequency_penalty": 0, "n": 1,
    "audio": None, "modalities": ["text"], "prediction": None,
    # vLLM's sampling extensions, which clients written for vLLM send
    "repetition_penalty": 1.0, "min_p": 0, "min_tokens": 0, "stop_token_ids": None,
}


def _is_off(value, off) -> bool:
    if value is None or value is False or (isinstance(value, (str, list, dict)) and not value):
        return True
    return not isinstance(value, bool) and value == off  # logprobs=0 and True are not "off"


def refuse(param: str | None, message: str, code: str | None = None) -> PydanticCustomError:
    """A validation error naming its field (`param`) where pydantic's loc cannot, and an OpenAI `code`."""
    return PydanticCustomError("invalid_request", message, {"param": param, "code": code})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _OpenAIRequest(_WithLookahead, _Sampling):
    """Fields shared by the OpenAI endpoints (OpenAI's defaults: temperature 1). `top_k`, `lookahead`,
    `timeout_s` and `ignore_eos` (as in vLLM: decode past EOS up to the token limit) are extensions."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(1.0, ge=0, le=2)
    ignore_eos: bool = False
    user: str | None = None  # an end-user identifier: accepted and ignored

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body):
        if isinstance(body, dict):
            for field, off in UNSUPPORTED.items():
                if not _is_off(body.get(field), off):
                    also = "" if off is None else f" (other than {json.dumps(off)})"
                    raise refuse(field, f"`{field}`{also} is not supported by this server", "unsupported_parameter")
        return body

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise refuse("stream_options", "`stream_options` is only allowed when `stream` is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1)

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise refuse("prompt", "batched prompts are not supported: send one prompt per request")
        return self

    @property
    def text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt

    @property
    def token_limit(self) -> int:
        return self.max_tokens or 16  # OpenAI's default, also for an explicit null


class ChatRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI: `max_completion_tokens`")
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 128


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)

"""HTTP request bodies; anything malformed is a 4xx with a message before it reaches a replica."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


class GenerateRequest(_WithLookahead, _Sampling):
    model_config = ConfigDict(extra="forbid")
    temperature: float | None = Field(None, ge=0, le=100)
    prompt: str | None = None
    input_ids: list[int] | None = None
    max_new_tokens: int = Field(128, ge=1)
    stop: list[str] = Field(default_factory=list)
    stream: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `prompt` (a string) or `input_ids` (a list of token ids)")
        if self.prompt is not None and not self.prompt:
            raise ValueError("`prompt` must not be empty")
        if self.input_ids is not None and not self.input_ids:
            raise ValueError("`input_ids` must not be empty")
        return self


class _OpenAIRequest(_WithLookahead, _Sampling):
    """Fields shared by the OpenAI endpoints (OpenAI's defaults: temperature 1); `top_k` is an
    extension; options it does not support (n > 1) are refused, not ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(1.0, ge=0, le=2)
    n: int = Field(1, ge=1, le=1)


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=1)

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("batched prompts are not supported: send one prompt per request")
        return self

    @property
    def text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int = Field(128, ge=1)


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)

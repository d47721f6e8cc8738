"""The request bodies bounded by this server's limits, built once when the ingress starts: the
routes take these types, so pydantic enforces the limits and FastAPI's OpenAPI schema states them
(a body valid by the schema is one the server serves, up to the prompt's length in tokens)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, Field, WithJsonSchema, create_model

from lookahead_core.engine.config import EngineConfig
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.serving import RequestLimits

from .option_bodies import logit_bias_schema, token_bias
from .request_bodies import (
    ChatRequest,
    CompletionPrompt,
    CompletionRequest,
    GenerateRequest,
    Lookahead,
    completion_prompt_schema,
    lookahead_schema,
)


@dataclass(frozen=True)
class Bodies:
    """The routes' body types."""

    generate: type[GenerateRequest]
    completion: type[CompletionRequest]
    chat: type[ChatRequest]


M = TypeVar("M", bound=BaseModel)


def _bound(base: type[M], **fields: Any) -> type[M]:
    """`base` under its own name, each named field retyped (its default, description and schema kept)."""
    retyped: dict[str, Any] = {name: (kind, base.model_fields[name]) for name, kind in fields.items()}
    return create_model(base.__name__, __base__=base, __doc__=base.__doc__, **retyped)


def decimals_up_to(top: int) -> str:
    """A regex of the decimal integers 0..top, without leading zeros: JSON Schema bounds an object's
    keys (logit_bias' token ids) by a pattern alone."""
    def digit(lo: int, hi: int) -> str:
        return str(lo) if lo == hi else f"[{lo}-{hi}]"

    def any_digits(count: int) -> str:
        return "" if count == 0 else "[0-9]" if count == 1 else f"[0-9]{{{count}}}"

    digits = str(top)
    width = len(digits)
    if width == 1:
        return f"^{digit(0, top)}$"
    alts = ["[0-9]"]  # shorter numbers, then those of `width` digits first below `top` at digit i, then `top`
    if width > 2:
        alts.append("[1-9][0-9]" + ("" if width == 3 else f"{{1,{width - 2}}}"))
    for i, d in enumerate(digits):
        lo = 1 if i == 0 else 0
        if int(d) > lo:
            alts.append(digits[:i] + digit(lo, int(d) - 1) + any_digits(width - i - 1))
    alts.append(digits)
    return f"^({'|'.join(alts)})$"


def bounded_bodies(model_name: str, vocab_size: int, engine: EngineConfig, limits: RequestLimits) -> Bodies:
    """Token ids within the vocabulary (input_ids, stop_token_ids, logit_bias' keys), token budgets within
    engine.max_new_tokens, (N, W, G) within the engine's (EngineConfig.check_params), stop strings as
    RequestLimits allows; `model` lists the one served id (any other is the route's 404, as OpenAI
    answers, so the schema only states it)."""
    def within_engine(value):
        if isinstance(value, LookaheadParams):
            engine.check_params(value)
        return value

    def biased_within_vocabulary(value):
        largest = max((t for t, _ in token_bias(value or {})), default=-1)
        if largest >= vocab_size:
            raise ValueError(f"logit_bias names token {largest}, beyond the vocabulary (ids 0..{vocab_size - 1})")
        return value

    token_id = Annotated[int, Field(ge=0, le=vocab_size - 1)]
    logit_bias = Annotated[dict[str, float] | None, AfterValidator(biased_within_vocabulary),
                           WithJsonSchema(logit_bias_schema(decimals_up_to(vocab_size - 1)))]
    budget = Annotated[int | None, Field(le=engine.max_new_tokens)]
    # at most the largest budget: more could never be met (a min_tokens above the request's own budget is
    # the processor's 400, the one pairing the schema cannot state)
    least = Annotated[int | None, Field(ge=0, le=engine.max_new_tokens)]
    lookahead = Annotated[Lookahead, AfterValidator(within_engine),
                          WithJsonSchema(lookahead_schema({"n": engine.max_n, "w": engine.max_w, "g": engine.max_g}))]
    stop_string = Annotated[str, Field(min_length=1, max_length=limits.max_stop_chars)]
    stop_list = Annotated[list[stop_string], Field(max_length=limits.max_stop_strings)]
    # OpenAI's `stop`: a string is one stop string, so none is allowed where no stop string is
    openai_stop = (stop_string | stop_list | None) if limits.max_stop_strings else (stop_list | None)
    prompt = Annotated[CompletionPrompt[token_id], WithJsonSchema(completion_prompt_schema(token_id))]
    model = Annotated[str | None, WithJsonSchema({"anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}],
                                                  "description": "the served model id (GET /v1/models)"})]
    tokens = {"stop_token_ids": list[token_id] | None, "logit_bias": logit_bias, "min_tokens": least}
    openai = {"model": model, "stop": openai_stop, "lookahead": lookahead, "max_tokens": budget, **tokens}
    return Bodies(
        generate=_bound(GenerateRequest, input_ids=list[token_id] | None, max_new_tokens=budget, stop=stop_list,
                        lookahead=lookahead, **tokens),
        completion=_bound(CompletionRequest, **openai, prompt=prompt),
        chat=_bound(ChatRequest, **openai, max_completion_tokens=budget),
    )

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


def bounded_bodies(model_name: str, vocab_size: int, engine: EngineConfig, limits: RequestLimits) -> Bodies:
    """Token ids within the vocabulary, token budgets within engine.max_new_tokens, (N, W, G) within
    the engine's (EngineConfig.check_params), stop strings as RequestLimits allows; `model` lists the
    one served id (any other is the route's 404, as OpenAI answers, so the schema only states it)."""
    def within_engine(value):
        if isinstance(value, LookaheadParams):
            engine.check_params(value)
        return value

    token_id = Annotated[int, Field(ge=0, le=vocab_size - 1)]
    budget = Annotated[int | None, Field(le=engine.max_new_tokens)]
    lookahead = Annotated[Lookahead, AfterValidator(within_engine),
                          WithJsonSchema(lookahead_schema({"n": engine.max_n, "w": engine.max_w, "g": engine.max_g}))]
    stop_string = Annotated[str, Field(min_length=1, max_length=limits.max_stop_chars)]
    stop_list = Annotated[list[stop_string], Field(max_length=limits.max_stop_strings)]
    # OpenAI's `stop`: a string is one stop string, so none is allowed where no stop string is
    openai_stop = (stop_string | stop_list | None) if limits.max_stop_strings else (stop_list | None)
    prompt = Annotated[CompletionPrompt[token_id], WithJsonSchema(completion_prompt_schema(token_id))]
    model = Annotated[str | None, WithJsonSchema({"anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}],
                                                  "description": "the served model id (GET /v1/models)"})]
    openai = {"model": model, "stop": openai_stop, "lookahead": lookahead, "max_tokens": budget}
    return Bodies(
        generate=_bound(GenerateRequest, input_ids=list[token_id] | None, max_new_tokens=budget, stop=stop_list,
                        lookahead=lookahead),
        completion=_bound(CompletionRequest, **openai, prompt=prompt),
        chat=_bound(ChatRequest, **openai, max_completion_tokens=budget),
    )

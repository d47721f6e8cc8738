"""HTTP routes: /generate, /health, /v1/models, /v1/completions, /v1/chat/completions.

Routes only: bodies, validated as types bounded by the server's limits (bounded_bodies.py), become one
ServeRequest (request_bodies.py), opened as a generation by whoever hosts the routes (the model
replica itself, or the separate ingress through a handle), and its Delta / Completion / RequestError
items are shaped into responses (response_bodies.py, streaming.py). The FastAPI app is built when
the hosting replica starts, once the model's vocabulary is known. Every error, on every route, is
OpenAI's envelope: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from lookahead_core.serving import Completion, Delta, RequestError, ServeRequest
from lookahead_core.serving.limits import MAX_BODY_BYTES

from .bounded_bodies import Bodies
from .guard import OPERATOR, GuardConfig, RequestGuard
from .request_bodies import ChatRequest, CompletionRequest, GenerateRequest
from .response_bodies import error_body, generate_body, openai_body
from .streaming import closing, generate_events, openai_events

NO_RESULT = RequestError(500, "generation ended without a result")

Items = AsyncIterator[Delta | Completion | RequestError]
# Starts a generation and returns its items; raises the RequestError of a request refused before its first item.
Opener = Callable[[ServeRequest], Awaitable[Items]]


def guard_config(guard: Mapping | None) -> GuardConfig:
    """The guard's settings as the app builder passes them (plain values, so Serve can ship them)."""
    guard = guard or {}
    return GuardConfig(api_keys=tuple(k.encode() for k in guard.get("api_keys", ())),
                       operator_keys=tuple(k.encode() for k in guard.get("operator_keys", ())),
                       open_paths=frozenset(guard.get("open_paths", ("/health",))),
                       max_body_bytes=guard.get("max_body_bytes", MAX_BODY_BYTES))


def error_response(err: RequestError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The HTTP status is the error's; the body has none. 503s tell the client when to retry."""
    if err.status == 503:
        headers = {**(headers or {}), "Retry-After": "1"}
    return JSONResponse(status_code=err.status, content={"error": error_body(err)}, headers=headers)


async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
    return error_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """One readable message per problem (malformed JSON lands here too); `param` names the first
    offending field. The status is the route's body's REFUSAL_STATUS (400 on the OpenAI routes, 422
    on /generate), as for the refusals its `to_request` raises."""
    problems, param = [], None
    for err in exc.errors():
        fields = [str(p) for p in err.get("loc", ()) if p != "body"]
        problems.append(f"{'.'.join(fields)}: {err.get('msg')}" if fields else str(err.get("msg")))
        if param is None:
            param = next((f for f in fields if not f.isdigit()), None)
    path = getattr(request.scope.get("route"), "path", "")
    return error_response(RequestError(request.app.state.refusal_status.get(path, 422), "; ".join(problems), param))


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Unknown paths (404) and wrong methods (405) get the envelope too."""
    return error_response(RequestError(exc.status_code, str(exc.detail)), exc.headers)  # e.g. 405's Allow


async def _completions(items, n: int = 1) -> list[Completion]:
    """Drain a generation to its n Completions; raises its RequestError."""
    done: list[Completion] = []
    try:
        async for item in items:
            if isinstance(item, RequestError):
                raise item
            if isinstance(item, Completion):
                done.append(item)
                if len(done) == n:
                    return done
    finally:
        await items.aclose()
    raise NO_RESULT


class Routes:
    """The routes of one server: `open` starts a generation, `info` is the model replica's state."""

    def __init__(self, open: Opener, info: Callable[[bool], Awaitable[dict]], model_name: str) -> None:
        self.open = open
        self.info = info
        self.model_name = model_name
        self.created = int(time.time())

    async def health(self, request: Request):
        """The replica's status for anyone (a load balancer's probe), its figures for an operator
        (the guard's `OPERATOR`); 503 while its engine cannot step, so a load balancer stops sending."""
        info = await self.info(bool(request.scope.get(OPERATOR, False)))
        return info if info["status"] != "failing" else JSONResponse(info, status_code=503)

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "lookahead-serve"}

    def _unknown_model(self, model: str) -> RequestError:
        return RequestError(404, f"the model `{model}` does not exist: this server serves `{self.model_name}`",
                            param="model", code="model_not_found")

    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    async def retrieve_model(self, model_id: str):
        if model_id != self.model_name:
            raise self._unknown_model(model_id)
        return self._model_card()

    async def generate(self, req: GenerateRequest):
        items = await self.open(req.to_request())
        if req.stream:
            return StreamingResponse(closing(generate_events(items), items), media_type="text/event-stream")
        return generate_body((await _completions(items))[0])

    # ---- OpenAI-compatible ------------------------------------------------------------------

    async def _openai(self, req: CompletionRequest | ChatRequest, chat: bool):
        if req.model not in (None, self.model_name):
            raise self._unknown_model(req.model)
        request = req.to_request()
        items = await self.open(request)
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + request.request_id[:24], "created": int(time.time()),
                "model": self.model_name}
        if req.stream:
            events = openai_events(items, head, chat, req.include_usage, req.n, req.continuous_usage)
            return StreamingResponse(closing(events, items), media_type="text/event-stream")
        return openai_body(head, await _completions(items, req.n), chat)

    async def completions(self, req: CompletionRequest):
        return await self._openai(req, chat=False)

    async def chat(self, req: ChatRequest):
        return await self._openai(req, chat=True)


def api_app(routes: Routes, bodies: Bodies, guard: GuardConfig) -> FastAPI:
    """The FastAPI app of one replica: `routes`, the POST routes taking `bodies`, behind `guard`."""
    app = FastAPI(title="lookahead-serve", description="Exact Lookahead Decoding on Ray Serve", redoc_url=None,
                  swagger_ui_oauth2_redirect_url=None)
    app.add_middleware(RequestGuard)
    app.state.guard = guard
    app.state.refusal_status = {}
    for exc, handler in ((RequestError, _request_error), (RequestValidationError, _validation_error),
                         (HTTPException, _http_error)):
        app.exception_handler(exc)(handler)
    app.get("/health")(routes.health)
    app.get("/v1/models")(routes.models)
    app.get("/v1/models/{model_id:path}")(routes.retrieve_model)
    for path, body, route in (("/generate", bodies.generate, routes.generate),
                              ("/v1/completions", bodies.completion, routes.completions),
                              ("/v1/chat/completions", bodies.chat, routes.chat)):
        app.post(path)(_taking(body, route))
        app.state.refusal_status[path] = body.REFUSAL_STATUS
    return app


def _taking(body: type, route):
    """`route` as an endpoint whose JSON body FastAPI validates as `body` (a type built at start,
    so it cannot be written in a signature)."""
    async def endpoint(req):
        return await route(req)

    endpoint.__annotations__["req"] = body
    endpoint.__name__ = route.__name__  # the operationId
    return endpoint

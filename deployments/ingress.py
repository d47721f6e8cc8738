"""HTTP ingress: /generate, /health, /v1/models, /v1/completions, /v1/chat/completions.

Routes only: bodies, validated as types bounded by the server's limits (bounded_bodies.py), become one
ServeRequest (request_bodies.py), sent to a replica, and its Delta / Completion / RequestError items are
shaped into responses (response_bodies.py, streaming.py). The FastAPI app is built when the replica
starts, once the model's vocabulary is known. Every error, on every route, is OpenAI's envelope:
{"error": {"message", "type", "param", "code"}}.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException

from lookahead_core.engine.config import EngineConfig
from lookahead_core.serving import Completion, Delta, RequestError, RequestLimits, ServeRequest

from .bounded_bodies import Bodies, bounded_bodies
from .guard import GuardConfig, RequestGuard
from .request_bodies import ChatRequest, CompletionRequest, GenerateRequest
from .response_bodies import error_body, generate_body, openai_body
from .streaming import closing, generate_events, openai_events

log = logging.getLogger("ray.serve")
OVERLOADED = RequestError(503, "server overloaded: too many queued requests, retry later", code="overloaded",
                          type="overloaded_error")
REPLICA_LOST = RequestError(503, "the model replica serving this request failed; retry", code="replica_failed",
                            type="server_error")
NO_RESULT = RequestError(500, "generation ended without a result")
# A replica lost before a request's first token: the request is sent again after these pauses.
# Serve's router keeps routing to a replica on a lost node until the controller has seen it die
# (a node's death takes Ray several health checks), so the pauses span that, not just one check.
RETRY_PAUSES_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


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


def api_app(api: "LookaheadAPI", bodies: Bodies) -> FastAPI:
    """The FastAPI app of one ingress replica: `api`'s routes, the POST routes taking `bodies`."""
    app = FastAPI(title="lookahead-serve", description="Exact Lookahead Decoding on Ray Serve", redoc_url=None,
                  swagger_ui_oauth2_redirect_url=None)
    app.add_middleware(RequestGuard)
    app.state.guard = api.guard
    app.state.refusal_status = {}
    for exc, handler in ((RequestError, _request_error), (RequestValidationError, _validation_error),
                         (HTTPException, _http_error)):
        app.exception_handler(exc)(handler)
    app.get("/health")(api.health)
    app.get("/v1/models")(api.models)
    app.get("/v1/models/{model_id:path}")(api.retrieve_model)
    for path, body, route in (("/generate", bodies.generate, api.generate),
                              ("/v1/completions", bodies.completion, api.completions),
                              ("/v1/chat/completions", bodies.chat, api.chat)):
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


# The ingress only awaits I/O: it asks Ray for no CPU, so the model replica can have every core.
@serve.deployment(name="LookaheadAPI", max_ongoing_requests=256, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class LookaheadAPI:
    def __init__(self, model: DeploymentHandle, model_name: str, engine: EngineConfig, limits: RequestLimits,
                 guard: dict | None = None) -> None:
        self.model = model
        self.stream_handle = model.options(stream=True)
        self.model_name = model_name
        self.created = int(time.time())
        guard = guard or {}
        self.guard = GuardConfig(
            api_keys=tuple(k.encode() for k in guard.get("api_keys", ())),
            open_paths=frozenset(guard.get("open_paths", ("/health",))),
            max_body_bytes=guard.get("max_body_bytes", 1 << 20),
        )
        self.engine_config = engine
        self.limits = limits

    async def _open(self, req: ServeRequest):
        """Start a generation and return its items (Delta..., Completion); raises the RequestError
        of a refused request. A replica that dies mid-stream ends the items with a RequestError, so
        no client waits on a request that can no longer finish."""
        for pause in (*RETRY_PAUSES_S, None):
            try:
                # A stream=True handle returns a generator; Ray types .remote() as either kind.
                gen = cast(DeploymentResponseGenerator, self.stream_handle.generate.remote(req))
                first = await gen.__anext__()
                break
            except BackPressureError:
                raise OVERLOADED from None
            except RayError as exc:
                # The replica died or its node is gone (an actor error, a lost node, a crashed
                # worker) and nothing has reached the client yet, so another replica can take the
                # request whole; the pause lets Serve's router learn that the replica is gone.
                if pause is None:
                    raise REPLICA_LOST from None
                log.warning("request %s: replica unreachable before its first item (%s); sent again in %.2f s",
                            req.request_id, type(exc).__name__, pause)
                await asyncio.sleep(pause)
        if isinstance(first, RequestError):
            raise first

        async def items() -> AsyncIterator[Delta | Completion | RequestError]:
            try:
                yield first
                async for item in gen:
                    yield item
            except RayError:
                yield REPLICA_LOST
            finally:
                # Client gone or response abandoned: cancel the replica's generator explicitly
                # rather than rely on Serve propagating the cancellation (a no-op once finished).
                gen.cancel()

        return items()

    async def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this once the replica is constructed. The bodies need the model's vocabulary,
        so this ingress replica is ready once a model replica answers (as its routes would need anyway)."""
        info = await self.model.info.remote()
        return api_app(self, bounded_bodies(self.model_name, info["vocab_size"], self.engine_config, self.limits))

    async def health(self):
        """The replica's state; 503 while its engine cannot step, so a load balancer stops sending."""
        info = await self.model.info.remote()
        return info if info["status"] == "ok" else JSONResponse(info, status_code=503)

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
        items = await self._open(req.to_request())
        if req.stream:
            return StreamingResponse(closing(generate_events(items), items), media_type="text/event-stream")
        return generate_body((await _completions(items))[0])

    # ---- OpenAI-compatible ------------------------------------------------------------------

    async def _openai(self, req: CompletionRequest | ChatRequest, chat: bool):
        if req.model not in (None, self.model_name):
            raise self._unknown_model(req.model)
        request = req.to_request()
        items = await self._open(request)
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

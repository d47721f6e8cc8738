"""HTTP ingress: /generate, /health, /v1/models, /v1/completions, /v1/chat/completions.

Every error, on every route, is OpenAI's envelope: {"error": {"message", "type", "param", "code"}}.
"""

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from .guard import GuardConfig, RequestGuard
from .schemas import ChatRequest, CompletionRequest, GenerateRequest, stop_list

app = FastAPI(title="lookahead-serve", description="Exact Lookahead Decoding on Ray Serve")
app.add_middleware(RequestGuard)

# Errors inside the server are {"status", "message"} plus, optionally, "type", "param" and "code".
OVERLOADED = {"status": 503, "message": "server overloaded: too many queued requests, retry later",
              "type": "overloaded_error", "code": "overloaded"}
REPLICA_LOST = {"status": 503, "message": "the model replica serving this request failed; retry",
                "type": "server_error", "code": "replica_failed"}


def openai_error(err: dict) -> dict:
    """OpenAI's error object: 4xx are invalid_request_error, 503 overloaded_error, other 5xx server_error."""
    status = err["status"]
    kind = err.get("type") or ("invalid_request_error" if status < 500 else
                               "overloaded_error" if status == 503 else "server_error")
    return {"message": err["message"], "type": kind, "param": err.get("param"), "code": err.get("code")}


def error_response(err: dict, headers: dict | None = None) -> JSONResponse:
    """The HTTP status is the error's; the body has none. 503s tell the client when to retry."""
    if err["status"] == 503:
        headers = {**(headers or {}), "Retry-After": "1"}
    return JSONResponse(status_code=err["status"], content={"error": openai_error(err)}, headers=headers)


def stream_error(err: dict) -> bytes:
    """An error after a streamed 200 has begun: the same envelope, plus the status it would have had."""
    return _sse({"error": {**openai_error(err), "status": err["status"]}})


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """One readable message per problem (malformed JSON lands here too); `param` names the first
    offending field. 400 on the OpenAI routes, as OpenAI and vLLM answer; 422 on /generate."""
    problems, param, code = [], None, None
    for err in exc.errors():
        ctx = err.get("ctx") or {}
        fields = [str(p) for p in err.get("loc", ()) if p != "body"]
        problems.append(f"{'.'.join(fields)}: {err.get('msg')}" if fields else str(err.get("msg")))
        if param is None:
            param = ctx.get("param") or next((f for f in fields if not f.isdigit()), None)
            code = ctx.get("code")
    openai_route = getattr(request.scope.get("route"), "path", "").startswith("/v1/")
    status = 400 if openai_route else 422
    return error_response({"status": status, "message": "; ".join(problems), "param": param, "code": code})


@app.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Unknown paths (404) and wrong methods (405) get the envelope too."""
    return error_response({"status": exc.status_code, "message": str(exc.detail)}, exc.headers)  # e.g. 405's Allow


async def _closing(events: AsyncIterator[bytes], chunks) -> AsyncIterator[bytes]:
    """Stream `events`; however the response ends (done, client gone), close `chunks` at once,
    which cancels the replica's generator and so frees the engine slot."""
    try:
        async for event in events:
            yield event
    finally:
        await chunks.aclose()


async def _summary(chunks) -> dict:
    """Drain a generation to its final summary ({"done": True, ...}) or its first {"error": ...}."""
    try:
        async for item in chunks:
            if "error" in item or item.get("done"):
                return item
    finally:
        await chunks.aclose()
    return {"error": {"status": 500, "message": "generation ended without a result"}}


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


# ---- the four OpenAI response shapes ---------------------------------------------------------

def usage(u: dict) -> dict:
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def finish_reason(reason: str) -> str:
    return "length" if reason in ("length", "timeout") else "stop"


def completion(head: dict, text: str, finish: str, used: dict) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {**head, "object": "text_completion", "choices": [choice], "usage": usage(used)}


def chat_completion(head: dict, text: str, finish: str, used: dict) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
    return {**head, "object": "chat.completion", "choices": [choice], "usage": usage(used)}


def completion_chunk(head: dict, text: str, finish: str | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {**head, "object": "text_completion", "choices": [choice]}


def chat_chunk(head: dict, delta: dict, finish: str | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {**head, "object": "chat.completion.chunk", "choices": [choice]}


async def openai_events(chunks, head: dict, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
    """SSE chunks as OpenAI streams them; with include_usage every chunk has `usage: null` and a
    last chunk with no choices carries the usage."""
    def event(text: str | None, finish: str | None = None, role: bool = False) -> bytes:
        if chat:
            delta = {"role": "assistant"} if role else ({} if text is None else {"content": text})
            chunk = chat_chunk(head, delta, finish)
        else:
            chunk = completion_chunk(head, text or "", finish)
        return _sse({**chunk, "usage": None} if include_usage else chunk)

    if chat:
        yield event(None, role=True)
    async for item in chunks:
        if "error" in item:
            yield stream_error(item["error"])
            return
        if item.get("done"):
            yield event(None, finish_reason(item["finish_reason"]))
            if include_usage:
                kind = "chat.completion.chunk" if chat else "text_completion"
                yield _sse({**head, "object": kind, "choices": [], "usage": usage(item["usage"])})
        elif item["text"]:
            yield event(item["text"])
    yield b"data: [DONE]\n\n"


# The ingress only awaits I/O: it asks Ray for no CPU, so the model replica can have every core.
@serve.deployment(name="LookaheadAPI", max_ongoing_requests=256, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class LookaheadAPI:
    def __init__(self, model: DeploymentHandle, model_name: str, guard: dict | None = None) -> None:
        self.model = model
        self.stream_handle = model.options(stream=True)
        self.model_name = model_name
        self.created = int(time.time())
        guard = guard or {}
        app.state.guard = GuardConfig(
            api_keys=tuple(k.encode() for k in guard.get("api_keys", ())),
            open_paths=frozenset(guard.get("open_paths", ("/health",))),
            max_body_bytes=guard.get("max_body_bytes", 1 << 20),
        )

    async def _open(self, body: dict):
        """Start a generation; returns (chunk iterator, None) or (None, error dict).

        A replica that dies mid-stream ends the iterator with an {"error": ...} item, so no
        client waits on a request that can no longer finish."""
        try:
            gen = self.stream_handle.generate.remote(body)
            first = await gen.__anext__()
        except BackPressureError:
            return None, OVERLOADED
        except RayError:
            return None, REPLICA_LOST
        if "error" in first:
            return None, first["error"]

        async def chunks() -> AsyncIterator[dict]:
            try:
                yield first
                async for item in gen:
                    yield item
            except RayError:
                yield {"error": REPLICA_LOST}
            finally:
                # Client gone or response abandoned: cancel the replica's generator explicitly
                # rather than rely on Serve propagating the cancellation (a no-op once finished).
                gen.cancel()

        return chunks(), None

    @app.get("/health")
    async def health(self) -> dict:
        info = await self.model.info.remote()
        return {"status": "ok", **info}

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "lookahead-serve"}

    def _unknown_model(self, model: str) -> dict:
        return {"status": 404, "param": "model", "code": "model_not_found",
                "message": f"the model `{model}` does not exist: this server serves `{self.model_name}`"}

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(self, model_id: str):
        return self._model_card() if model_id == self.model_name else error_response(self._unknown_model(model_id))

    @app.post("/generate")
    async def generate(self, req: GenerateRequest):
        body = req.model_dump()
        chunks, err = await self._open(body)
        if err:
            return error_response(err)
        if req.stream:
            async def events() -> AsyncIterator[bytes]:
                async for item in chunks:
                    if "error" in item:
                        yield stream_error(item["error"])
                        return
                    yield _sse(item)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(_closing(events(), chunks), media_type="text/event-stream")
        summary = await _summary(chunks)
        if "error" in summary:
            return error_response(summary["error"])
        summary.pop("done")
        return summary

    # ---- OpenAI-compatible ------------------------------------------------------------------

    async def _openai(self, prompt: dict, req, chat: bool):
        if req.model not in (None, self.model_name):
            return error_response(self._unknown_model(req.model))
        body = {**prompt, "max_new_tokens": req.token_limit, "stop": stop_list(req.stop), **req.sampling(),
                "timeout_s": req.timeout_s, "ignore_eos": req.ignore_eos,
                "lookahead": req.lookahead if isinstance(req.lookahead, str) else req.lookahead.model_dump()}
        chunks, err = await self._open(body)
        if err:
            return error_response(err)
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], "created": int(time.time()),
                "model": self.model_name}
        if req.stream:
            events = openai_events(chunks, head, chat, req.include_usage)
            return StreamingResponse(_closing(events, chunks), media_type="text/event-stream")
        item = await _summary(chunks)
        if "error" in item:
            return error_response(item["error"])
        shape = chat_completion if chat else completion
        return {**shape(head, item["text"], finish_reason(item["finish_reason"]), item["usage"]),
                "lookahead": item["lookahead"]}

    @app.post("/v1/completions")
    async def completions(self, req: CompletionRequest):
        return await self._openai({"prompt": req.text}, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(self, req: ChatRequest):
        return await self._openai({"messages": [m.model_dump() for m in req.messages]}, req, chat=True)

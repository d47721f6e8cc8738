"""HTTP ingress: /generate, /health, /v1/models, /v1/completions, /v1/chat/completions."""

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

from .guard import GuardConfig, RequestGuard
from .schemas import ChatRequest, CompletionRequest, GenerateRequest, stop_list

app = FastAPI(title="lookahead-serve", description="Exact Lookahead Decoding on Ray Serve")
app.add_middleware(RequestGuard)

OVERLOADED = {"status": 503, "message": "server overloaded: too many queued requests, retry later"}
REPLICA_LOST = {"status": 503, "message": "the model replica serving this request failed; retry"}


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 with one readable message per problem (malformed JSON lands here too)."""
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return JSONResponse(status_code=422, content={"error": {"status": 422, "message": "; ".join(problems)}})


def _error_response(err: dict) -> JSONResponse:
    """Errors from replicas carry their status; 503s tell the client when to retry."""
    headers = {"Retry-After": "1"} if err["status"] == 503 else None
    return JSONResponse(status_code=err["status"], content={"error": err}, headers=headers)


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


def _chat_prompt(messages: list[dict]) -> str:
    # A plain transcript ending with the assistant's turn (the default model has no chat template).
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


@serve.deployment(name="LookaheadAPI", max_ongoing_requests=256)
@serve.ingress(app)
class LookaheadAPI:
    def __init__(self, model: DeploymentHandle, model_name: str, guard: dict | None = None) -> None:
        self.model = model
        self.stream_handle = model.options(stream=True)
        self.model_name = model_name
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

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "lookahead-serve"}]}

    @app.post("/generate")
    async def generate(self, req: GenerateRequest):
        body = req.model_dump()
        chunks, err = await self._open(body)
        if err:
            return _error_response(err)
        if req.stream:
            async def events() -> AsyncIterator[bytes]:
                async for item in chunks:
                    yield _sse(item)
                    if "error" in item:
                        return
                yield b"data: [DONE]\n\n"

            return StreamingResponse(_closing(events(), chunks), media_type="text/event-stream")
        summary = await _summary(chunks)
        if "error" in summary:
            return _error_response(summary["error"])
        summary.pop("done")
        return summary

    # ---- OpenAI-compatible ------------------------------------------------------------------

    async def _openai(self, prompt: str, req, chat: bool):
        body = {"prompt": prompt, "max_new_tokens": req.max_tokens, "stop": stop_list(req.stop), **req.sampling(),
                "timeout_s": req.timeout_s,
                "lookahead": req.lookahead if isinstance(req.lookahead, str) else req.lookahead.model_dump()}
        chunks, err = await self._open(body)
        if err:
            return _error_response(err)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def finish(reason: str) -> str:
            return "length" if reason in ("length", "timeout") else "stop"

        if req.stream:
            async def events() -> AsyncIterator[bytes]:
                if chat:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                                "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
                async for item in chunks:
                    if "error" in item:
                        yield _sse(item)
                        return
                    if item.get("done"):
                        end = {"index": 0, "finish_reason": finish(item["finish_reason"])}
                        end.update({"delta": {}} if chat else {"text": "", "logprobs": None})
                        yield _sse({"id": rid, "object": kind + (".chunk" if chat else ""), "created": created,
                                    "model": self.model_name, "choices": [end], "usage": item["usage"]})
                    elif item["text"]:
                        choice = {"index": 0, "finish_reason": None}
                        choice.update({"delta": {"content": item["text"]}} if chat else {"text": item["text"], "logprobs": None})
                        yield _sse({"id": rid, "object": kind + (".chunk" if chat else ""), "created": created,
                                    "model": self.model_name, "choices": [choice]})
                yield b"data: [DONE]\n\n"

            return StreamingResponse(_closing(events(), chunks), media_type="text/event-stream")
        item = await _summary(chunks)
        if "error" in item:
            return _error_response(item["error"])
        usage = item["usage"]
        choice = {"index": 0, "finish_reason": finish(item["finish_reason"])}
        if chat:
            choice["message"] = {"role": "assistant", "content": item["text"]}
        else:
            choice.update({"text": item["text"], "logprobs": None})
        return {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [choice],
                "usage": {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]},
                "lookahead": item["lookahead"]}

    @app.post("/v1/completions")
    async def completions(self, req: CompletionRequest):
        return await self._openai(req.text, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(self, req: ChatRequest):
        return await self._openai(_chat_prompt([m.model_dump() for m in req.messages]), req, chat=True)

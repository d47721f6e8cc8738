"""ASGI guard in front of every route: bearer-token auth, then a cap on the request body.

Both run before FastAPI parses anything, so an unauthenticated or oversized request costs
no parsing, no tokenization and no engine slot. The guard also says who may read the replica's
figures (`OPERATOR` in the request's scope): an operator key's holder, or any key's where no
operator key is set, or anyone where no key is set at all.
"""
from __future__ import annotations

import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from lookahead_core.serving.limits import MAX_BODY_BYTES

# The request scope's key: True where the caller may read the replica's figures on /health.
OPERATOR = "lookahead.operator"


@dataclass(frozen=True)
class GuardConfig:
    api_keys: tuple[bytes, ...] = ()
    open_paths: frozenset[str] = field(default_factory=lambda: frozenset({"/health"}))
    max_body_bytes: int = MAX_BODY_BYTES
    operator_keys: tuple[bytes, ...] = ()  # keys that may also read /health's figures; they pass as API keys too

    def operator(self, presented: bytes | None) -> bool:
        """Whether a caller presenting `presented` (None: no bearer token) may read the figures."""
        if not self.api_keys and not self.operator_keys:
            return True
        if presented is None:
            return False
        if self.operator_keys:
            return key_matches(presented, self.operator_keys)
        return key_matches(presented, self.api_keys)


def key_matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    """Constant-time in the presented key: every configured key is compared, no early exit."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(presented, key)
    return ok


def _route_path(scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


class RequestGuard:
    """Pure ASGI middleware; reads its `GuardConfig` from `app.state.guard` (the ingress replica
    builds its app at start-up and sets it there)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        config: GuardConfig | None = getattr(getattr(scope.get("app"), "state", None), "guard", None)
        if scope["type"] != "http" or config is None:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        presented = token.strip() if scheme.lower() == b"bearer" else None
        keys = config.api_keys + config.operator_keys
        if keys and _route_path(scope) not in config.open_paths:
            if presented is None or not key_matches(presented, keys):
                message = "missing API key: send `Authorization: Bearer <key>`" if not auth else "invalid API key"
                await _reply(send, 401, message, [(b"www-authenticate", b"Bearer")])
                return
        scope[OPERATOR] = config.operator(presented)
        limit = config.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await _reply(send, 400, "invalid Content-Length header")
                return
            if declared > limit:
                await _reply(send, 413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
                return
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): read the body under the cap, then replay it.
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body arrived: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _reply(send, 413, f"request body exceeds the limit of {limit} bytes")
                return
            body.append(chunk)
            more = message.get("more_body", False)
        await self.app(scope, _replay([{"type": "http.request", "body": b"".join(body), "more_body": False}], receive), send)


def _replay(messages: list[dict], receive):
    async def replayed():
        if messages:
            return messages.pop(0)
        return await receive()  # e.g. http.disconnect, so streaming responses see the client leave

    return replayed


async def _reply(send, status: int, message: str, extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

"""The ASGI guard on its own: auth and body limits, before any route runs."""
import asyncio
import json
from types import SimpleNamespace

import pytest

from deployments.guard import OPERATOR, GuardConfig, RequestGuard, key_matches

KEY = b"k" * 20


async def _echo(scope, receive, send):
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def call(config, path="/generate", headers=(), chunks=(b"{}",), content_length=True):
    """Run one request through the guard; returns (status, headers, body)."""
    chunks = list(chunks)
    hdrs = [(k.lower(), v) for k, v in headers]
    if content_length:
        hdrs.append((b"content-length", str(sum(map(len, chunks))).encode()))
    scope = {"type": "http", "path": path, "root_path": "", "headers": hdrs,
             "app": SimpleNamespace(state=SimpleNamespace(guard=config))}
    sent, pending = [], [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(RequestGuard(_echo)(scope, receive, send))
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


def test_key_matches_only_configured_keys():
    assert key_matches(KEY, (b"x" * 20, KEY))
    assert not key_matches(KEY[:-1], (KEY,)) and not key_matches(b"", (KEY,)) and not key_matches(KEY, ())


def test_no_keys_means_no_auth():
    assert call(GuardConfig()) == (200, {}, b"{}")


@pytest.mark.parametrize("headers, message", [
    ((), "missing API key"),
    (((b"authorization", b"Bearer " + b"z" * 20),), "invalid API key"),
    (((b"authorization", b"Basic " + KEY),), "invalid API key"),
    (((b"authorization", b"Bearer"),), "invalid API key"),
])
def test_missing_or_wrong_key_is_401(headers, message):
    status, hdrs, body = call(GuardConfig(api_keys=(KEY,)), headers=headers)
    assert status == 401 and hdrs[b"www-authenticate"] == b"Bearer"
    error = json.loads(body)["error"]
    assert message in error["message"] and error["type"] == "authentication_error"
    assert set(error) == {"message", "type", "param", "code"}  # OpenAI's envelope


def test_right_key_and_open_paths_pass():
    config = GuardConfig(api_keys=(KEY,))
    assert call(config, headers=((b"Authorization", b"Bearer " + KEY),))[0] == 200
    assert call(config, headers=((b"authorization", b"bearer " + KEY),))[0] == 200
    assert call(config, path="/health")[0] == 200


def test_route_prefix_is_stripped_before_matching_open_paths():
    config = GuardConfig(api_keys=(KEY,))
    scope_path = "/app/health"
    sent = []

    async def send(m):
        sent.append(m)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "path": scope_path, "root_path": "/app", "headers": [],
             "app": SimpleNamespace(state=SimpleNamespace(guard=config))}
    asyncio.run(RequestGuard(_echo)(scope, receive, send))
    assert sent[0]["status"] == 200


def test_body_over_the_limit_is_413_declared_or_chunked():
    config = GuardConfig(max_body_bytes=1024)
    status, _, body = call(config, chunks=(b"x" * 1025,))
    assert status == 413 and "1025 bytes exceeds the limit of 1024" in json.loads(body)["error"]["message"]
    status, _, body = call(config, chunks=(b"x" * 600, b"y" * 600), content_length=False)
    assert status == 413 and "exceeds the limit of 1024" in json.loads(body)["error"]["message"]


def test_chunked_body_under_the_limit_is_replayed_whole():
    assert call(GuardConfig(max_body_bytes=1024), chunks=(b"ab", b"cd", b"ef"), content_length=False) == (200, {}, b"abcdef")


def test_bad_content_length_is_400():
    config = GuardConfig()
    scope_headers = ((b"content-length", b"ten"),)
    status, _, body = call(config, headers=scope_headers, content_length=False)
    assert status == 400 and "Content-Length" in json.loads(body)["error"]["message"]


def operator_flag(config, headers=(), path="/health"):
    """What the guard tells the route of a request: whether its caller may read the figures."""
    seen = {}

    async def route(scope, receive, send):
        seen["operator"] = scope.get(OPERATOR)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    scope = {"type": "http", "path": path, "root_path": "", "headers": [(b"content-length", b"0"), *headers],
             "app": SimpleNamespace(state=SimpleNamespace(guard=config))}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass

    asyncio.run(RequestGuard(route)(scope, receive, send))
    return seen.get("operator")


OPERATOR_KEY = b"o" * 24


@pytest.mark.parametrize("config, key, operator", [
    (GuardConfig(), None, True),  # no key anywhere: a local server, open to its user
    (GuardConfig(api_keys=(KEY,)), None, False),  # the open /health without a key: its status alone
    (GuardConfig(api_keys=(KEY,)), KEY, True),
    (GuardConfig(api_keys=(KEY,)), b"z" * 20, False),
    (GuardConfig(api_keys=(KEY,), operator_keys=(OPERATOR_KEY,)), KEY, False),  # a tenant's key: no figures
    (GuardConfig(api_keys=(KEY,), operator_keys=(OPERATOR_KEY,)), OPERATOR_KEY, True),
])
def test_only_an_operator_reads_the_figures(config, key, operator):
    headers = () if key is None else ((b"authorization", b"Bearer " + key),)
    assert operator_flag(config, headers) is operator


def test_an_operator_key_passes_every_route():
    config = GuardConfig(api_keys=(KEY,), operator_keys=(OPERATOR_KEY,))
    assert call(config, headers=((b"authorization", b"Bearer " + OPERATOR_KEY),))[0] == 200

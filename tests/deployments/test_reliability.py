"""Reliability over real HTTP: auth, limits, overload, disconnects, timeouts and a killed replica.

Runs against a second app ("guarded", small queue, API keys) beside the session's main app, so
killing its replica leaves the other tests alone.
"""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from lookahead_core.engine.host.async_engine import STATUS_MAX_AGE_S
from lookahead_core.serving import sse
from tests.fixtures import fresh_health, wait_until

KEY = "test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_NEW = 1000


@pytest.fixture(scope="module")
def guarded(server, tiny_model_dir):
    from ray import serve

    from deployments.app import build_app

    args = {
        "model": {"path": str(tiny_model_dir), "name": "tiny", "dtype": "float32"},
        "engine": {"max_batch": 2, "max_seq_len": 1024, "max_new_tokens": MAX_NEW, "prefill_chunk": 32, "max_waiting": 2,
                   "lookahead": {"n": 3, "w": 3, "g": 3}},
        "limits": {"max_body_bytes": 4096, "max_prompt_tokens": 100, "request_timeout_s": 60},
        "auth": {"api_keys": [KEY]},
        "num_cpus": 0,
    }
    serve.run(build_app(args), name="guarded", route_prefix="/guarded")
    url = server + "/guarded"
    wait_until(lambda: requests.get(url + "/health", timeout=5).status_code == 200, 60)
    yield url
    serve.delete("guarded")


def health(url):
    return fresh_health(url, headers=AUTH)


def gen(url, body, **kw):
    return requests.post(url + "/generate", json=body, headers=AUTH, timeout=120, **kw)


def long_body(**extra):
    return {"prompt": "0123", "max_new_tokens": MAX_NEW, "lookahead": "off", **extra}  # no EOS in 1000 tokens


def test_auth_is_required_except_on_health(guarded):
    r = requests.post(guarded + "/generate", json={"prompt": "a", "max_new_tokens": 2}, timeout=30)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert "missing API key" in r.json()["error"]["message"]
    r = requests.get(guarded + "/v1/models", headers={"Authorization": "Bearer wrong-key-0000000000"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["message"] == "invalid API key"
    ok = gen(guarded, {"prompt": "a", "max_new_tokens": 2})
    assert ok.status_code == 200, ok.text
    # /health answers anyone with its status alone: no caller without a key reads the traffic, the
    # prefix cache's reuse, the history or the step costs
    open_health = requests.get(guarded + "/health", timeout=30)
    assert open_health.status_code == 200 and open_health.json() == {"status": "ok"}
    figures = health(guarded)
    assert figures["status"] == "ok" and {"prefix_cache", "history", "step_costs_ms", "running"} <= set(figures)


@pytest.mark.parametrize("body, status, message", [
    ({"prompt": "x" * 5000, "max_new_tokens": 2}, 413, "exceeds the limit of 4096 bytes"),
    ({"prompt": "x" * 150, "max_new_tokens": 2}, 400, "the prompt has 150 tokens; this server accepts at most 100"),
    ({"input_ids": [5] * 101, "max_new_tokens": 2}, 400, "accepts at most 100"),
    # the server's limits bound the body's type (deployments/bounded_bodies.py): /generate's 422
    ({"prompt": "x", "max_new_tokens": MAX_NEW + 1}, 422, f"max_new_tokens: Input should be less than or equal to {MAX_NEW}"),
    ({"prompt": "x", "max_new_tokens": 2, "lookahead": {"n": 3, "w": 17, "g": 2}}, 422, "w=17 exceeds"),
    ({"prompt": "x", "max_new_tokens": 2, "stop": ["s"] * 17}, 422, "stop: List should have at most 16 items"),
    ({"prompt": "x", "max_new_tokens": 2, "stop": ["s" * 300]}, 422, "at most 256 characters"),
    ({"prompt": "x", "max_new_tokens": 2, "timeout_s": 0}, 422, "timeout_s"),
])
def test_limits_are_4xx_with_a_message(guarded, body, status, message):
    r = gen(guarded, body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


def test_full_generation_runs_to_length(guarded):
    # Precondition of the tests below: this request would decode for a while if left alone.
    body = gen(guarded, long_body()).json()
    assert body["finish_reason"] == "length" and body["usage"]["completion_tokens"] == MAX_NEW


def test_timeout_returns_partial_output_or_408(guarded):
    t0 = time.time()
    body = gen(guarded, long_body(timeout_s=0.3)).json()
    assert time.time() - t0 < 5
    assert body["finish_reason"] == "timeout" and 0 < body["usage"]["completion_tokens"] < MAX_NEW
    # Both slots busy: a request whose own timeout passes in the queue gets 408 and a message.
    with ThreadPoolExecutor(2) as pool:
        busy = [pool.submit(gen, guarded, long_body(timeout_s=3)) for _ in range(2)]
        assert wait_until(lambda: health(guarded)["running"] == 2, 10)
        r = gen(guarded, long_body(timeout_s=0.2))
        assert r.status_code == 408 and "(its timeout_s) before its first token" in r.json()["error"]["message"]
        assert all(f.result().status_code == 200 for f in busy)
    assert wait_until(lambda: health(guarded)["running"] == 0, 10)


def test_client_disconnect_aborts_the_request_and_frees_its_slot(guarded):
    t0 = time.time()
    gen(guarded, long_body())
    full_s = time.time() - t0
    before = health(guarded)["replica"]["aborted_requests"]
    r = gen(guarded, long_body(stream=True), stream=True)
    events = sse.events(r.iter_lines())  # held: a dropped generator would close the stream
    assert next(events)  # the first event: the request is decoding
    assert health(guarded)["running"] == 1
    r.close()  # the client hangs up mid-stream
    t_close = time.time()
    assert wait_until(lambda: health(guarded)["running"] == 0, full_s)
    freed_s = time.time() - t_close - (STATUS_MAX_AGE_S + 0.1)  # the read that saw it first waited this long
    after = health(guarded)
    assert after["replica"]["aborted_requests"] == before + 1 and freed_s < full_s / 2, (freed_s, full_s, before, after)
    print(f"slot freed {freed_s:.3f} s after the disconnect (full request {full_s:.2f} s)")


def test_overload_is_a_quick_503_and_the_server_stays_healthy(guarded):
    def one(_):
        t0 = time.time()
        r = gen(guarded, long_body(max_new_tokens=200))
        return r.status_code, r.headers.get("retry-after"), time.time() - t0, r.json()

    rss, refused = [], []
    for _ in range(3):
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(one, range(12)))
        codes = [c for c, *_ in results]
        assert set(codes) <= {200, 503} and codes.count(200) >= 4 and codes.count(503) >= 1, codes
        for code, retry, elapsed, body in results:
            if code == 503:
                assert retry == "1" and "overloaded" in body["error"]["message"] and elapsed < 2
                refused.append(elapsed)
        assert wait_until(lambda: health(guarded)["running"] == 0, 30)
        rss.append(health(guarded)["replica"]["rss_mb"])
    assert gen(guarded, {"prompt": "a", "max_new_tokens": 4}).status_code == 200
    assert rss[-1] - rss[0] < 0.1 * rss[0], rss  # bounded: the bursts leave nothing behind
    print(f"overload: {len(refused)} of 36 refused with 503, slowest refusal {max(refused) * 1000:.0f} ms; RSS after bursts {rss} MB")


def test_killed_replica_is_replaced_and_no_request_hangs(guarded):
    import ray

    old = health(guarded)["replica"]["pid"]
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith("SERVE_REPLICA::guarded#LookaheadModel")]

    streaming = [threading.Event(), threading.Event()]

    def stream_one(i):
        try:
            r = gen(guarded, long_body(stream=True), stream=True)
            if r.status_code != 200:
                return r.status_code, None
            last = None
            for event in sse.events(r.iter_lines()):
                streaming[i].set()
                last = event
            return 200, "done" if last == sse.DONE else last
        except requests.RequestException as exc:
            return "connection", str(exc)

    with ThreadPoolExecutor(2) as pool:
        inflight = [pool.submit(stream_one, i) for i in range(2)]
        # Both have streamed tokens: the ingress cannot resend them elsewhere, so each must end
        # with an explicit error.
        assert wait_until(lambda: all(e.is_set() for e in streaming), 10)
        t_kill = time.time()
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        ended = [f.result(timeout=60) for f in inflight]  # none hangs
    print("in flight at the kill ended with:", ended)
    for status, last in ended:
        # Each in-flight request ends with an explicit error: an SSE error event or an error status.
        assert status != 200 or (isinstance(last, dict) and last["error"]["status"] == 503), (status, last)
    assert wait_until(lambda: gen(guarded, {"prompt": "a", "max_new_tokens": 4}).status_code == 200, 60, interval=0.2)
    recovery_s = time.time() - t_kill
    assert health(guarded)["replica"]["pid"] != old
    print(f"replica recovery: {recovery_s:.1f} s")

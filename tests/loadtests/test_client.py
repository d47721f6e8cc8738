"""The one load client: stream timing and outcomes from /generate's SSE, closed-loop bodies, percentiles;
against the session's real Serve app, a streamed request and a refused one."""
import json

import pytest

from deployments.request_bodies import CompletionRequest, GenerateRequest
from loadtests.client import (
    REQUEST_KINDS,
    Outcome,
    generate,
    generate_body,
    lookahead_field,
    parse_mix,
    percentiles,
    prompt_cycle,
    read_openai_stream,
    read_stream,
    route_for,
)
from lookahead_core.serving import sse


def lines(*events) -> list[bytes]:
    out = []
    for e in events:
        out += (sse.DONE_EVENT if e == sse.DONE else sse.encode(e)).splitlines()
    return out


def ticking():
    t = iter(range(100, 200))
    return lambda: float(next(t))


def test_a_stream_is_timed_token_by_token_and_keeps_its_summary():
    summary = {"done": True, "usage": {"completion_tokens": 5}, "lookahead": {"compression": 2.5}}
    out = read_stream(Outcome(start=99.0), lines({"token_ids": [1, 2], "text": "ab"}, {"token_ids": [3], "text": "c"},
                                                 {"token_ids": [4, 5], "text": "de"}, summary, sse.DONE), clock=ticking())
    assert out.ok and out.summary == summary and out.tokens == 5
    assert (out.first, out.last, out.end) == (100.0, 102.0, 103.0)
    assert out.ttft == 1.0 and out.latency == 4.0 and out.tpot == 2.0 / 4


def test_an_error_event_or_a_missing_summary_is_a_failed_outcome():
    err = read_stream(Outcome(start=0.0), lines({"token_ids": [1], "text": "a"},
                                                {"error": {"status": 503, "message": "replica died"}}, sse.DONE))
    assert not err.ok and err.error == "replica died" and err.tokens == 1
    cut = read_stream(Outcome(start=0.0), lines({"token_ids": [1], "text": "a"}))
    assert not cut.ok and "without its summary" in cut.error
    assert Outcome(start=0.0).tpot is None


def test_bodies_cycle_prompts_per_user_and_name_the_lookahead():
    body = prompt_cycle(["p0", "p1", "p2"], chat=True, max_new_tokens=7, lookahead="off", temperature=1.0)
    assert body(0, 0)["messages"] == [{"role": "user", "content": "p0"}] and body(0, 1)["messages"][0]["content"] == "p1"
    assert body(1, 0)["messages"][0]["content"] == "p1"  # user 1 starts 7 prompts on
    assert body(0, 0) | {"messages": None} == {"messages": None, "max_new_tokens": 7, "temperature": 1.0,
                                                 "lookahead": "off", "stream": True}
    assert generate_body("x", chat=False, max_new_tokens=1)["prompt"] == "x"
    assert lookahead_field("3,2,2") == {"n": 3, "w": 2, "g": 2} and lookahead_field("auto") == "auto"


def test_a_mix_names_known_kinds_and_each_kind_is_a_valid_request():
    assert parse_mix("off=4,fixed=1,top_p") == {"off": 4.0, "fixed": 1.0, "top_p": 1.0}
    with pytest.raises(ValueError, match="unknown request kind 'wide'"):
        parse_mix("off=1,wide=2")
    with pytest.raises(ValueError, match="no positive weight"):
        parse_mix("off=0")
    for fields in REQUEST_KINDS.values():
        path, body = route_for({**generate_body("def f():", chat=False, max_new_tokens=8), **fields})
        # what the server parses: no kind is refused
        (GenerateRequest if path == "/generate" else CompletionRequest).model_validate(body)
    assert route_for({**generate_body("x", chat=False, max_new_tokens=8), **REQUEST_KINDS["choices"]})[1]["n"] == 4


def test_percentiles_are_nearest_rank_and_skip_missing_values():
    assert percentiles([4.0, None, 1.0, 3.0, 2.0], (50, 100)) == {"p50": 3.0, "p100": 4.0}
    assert percentiles([], (50,)) == {"p50": None}


def test_a_real_stream_and_a_refusal(server):
    out = generate(server, generate_body("def add(a, b):", chat=False, max_new_tokens=6))
    assert out.ok and out.status == 200, out.error
    assert out.tokens == out.summary["usage"]["completion_tokens"] == len(out.summary["token_ids"])
    assert 0 < out.ttft <= out.latency
    bad = generate(server, generate_body("x", chat=False, max_new_tokens=-1))
    assert bad.status == 422 and not bad.ok and "max_new_tokens" in bad.error, json.dumps(bad.error)


def test_an_openai_stream_counts_chat_deltas_and_completion_texts_as_arrivals():
    ticks = iter(range(100))
    chat = [b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}',
            b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}',
            b'data: {"choices": [{"index": 0, "delta": {"content": " there"}}]}',
            b'data: {"choices": [], "usage": {"completion_tokens": 3}}', b"data: [DONE]"]
    out = read_openai_stream(Outcome(start=0), chat, clock=lambda: next(ticks))
    assert out.first == 0 and out.last == 1 and out.tokens == 3 and out.error is None  # the role chunk has no text
    completions = [b'data: {"choices": [{"index": 1, "text": "a"}]}', b'data: {"choices": [{"index": 0, "text": "b"}]}',
                   b'data: {"choices": [], "usage": {"completion_tokens": 8}}', b"data: [DONE]"]
    out = read_openai_stream(Outcome(start=0), completions, clock=lambda: next(ticks))
    assert out.first is not None and out.tokens == 8 and out.error is None

"""Every endpoint of a real Serve app over HTTP; outputs equal `lookahead_core.generate`."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lookahead_core import LookaheadParams, generate
from lookahead_core.serving import sse
from tests.fixtures import fresh_health, wait_until


@pytest.fixture(scope="module")
def local(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def expected(local, prompt, max_new, params=None):
    model, tok = local
    ids = tok(prompt)["input_ids"]
    return generate(model, torch.tensor([ids]), max_new_tokens=max_new, params=params).tokens


def post(server, path, body, **kw):
    return requests.post(server + path, json=body, timeout=60, **kw)


def test_health_and_models(server):
    h = requests.get(server + "/health", timeout=10).json()
    assert h["status"] == "ok" and h["model"] == "tiny"
    assert h["dtype"] == "float32" and h["device"] == "cpu" and h["torch_threads"] >= 1
    assert h["seeded_text"] == "fixed by the seed, up to rounding-level ties"  # float32: whatever runs beside a request
    # the HTTP stack above Ray's 15, where Ray started it: the replica's process, Serve's proxy and,
    # with the shipped environment (configs/ray.env), its HAProxy ingress
    plan = h["core_plan"]
    assert plan["nice_now"] == 0 and plan["http_nice_now"]["replica"] == 5 and "http_nice_error" not in plan
    for kind in ("proxy ", "haproxy "):
        stack = [n for who, n in plan["http_nice_now"].items() if who.startswith(kind)]
        assert stack and set(stack) == {5}, (kind, plan["http_nice_now"])
    assert h["step_costs_ms"]["b1t1"] > 0  # the warm-up's forwards, measured
    total, count = h["step_totals_ms"]["b1t1"]
    assert count > 0 and total >= count * 0.01  # every forward summed and counted
    step = h["step_time_ms"]  # per step: decode forward, prefill forward and the host's share beside them
    assert step["steps"] > 0 and step["forward"] > 0 and step["prefill"] > 0 and step["host"] > 0
    history = h["history"]  # the replica's cross-request tables, bounded and sized
    assert history["successors"]["bytes"] >= 128 * history["successors"]["k"] * 4  # vocab x k int32
    assert history["text"]["capacity"] >= history["text"]["tokens"] and history["text"]["bytes"] > 0
    m = requests.get(server + "/v1/models", timeout=10).json()
    assert m["data"][0]["id"] == "tiny"
    # the schema names the one model id the OpenAI routes accept
    spec = requests.get(server + "/openapi.json", timeout=10).json()["components"]["schemas"]
    for body in ("CompletionRequest", "ChatRequest"):
        assert spec[body]["properties"]["model"]["anyOf"][0]["enum"] == ["tiny"]
    # ... and this server's limits: the tiny model's 128 ids, engine max_new_tokens 64, (N, W, G) up to (8, 16, 16),
    # 16 stop strings of 256 characters (the routes take the bodies bounded by them: deployments/bounded_bodies.py)
    generate = spec["GenerateRequest"]["properties"]
    assert generate["input_ids"]["anyOf"][0]["items"]["maximum"] == 127
    assert spec["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]["items"]["maximum"] == 127
    assert spec["ChatRequest"]["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 64
    assert generate["lookahead"]["anyOf"][1]["properties"]["n"]["maximum"] == 8
    assert (generate["stop"]["maxItems"], generate["stop"]["items"]["maxLength"]) == (16, 256)
    docs = requests.get(server + "/docs", timeout=10)
    assert docs.status_code == 200 and "url: '/openapi.json'" in docs.text


def test_decode_compiles_in_the_background_then_serves_the_same_tokens(server, local):
    """The replica answered from the start (eagerly) while its decode graph and its prefill graph
    compiled (or loaded) in the background ("auto"); once /health shows them ready, the prompt
    prefills in the prefill graph and every step runs compiled, with the tokens the library gives."""
    def graphs():
        decode, prefill = fresh_health(server)["compiled_decode"]["buckets"]
        return decode, prefill

    wait_until(lambda: all(g["ready"] or "error" in g for g in graphs()), 300, interval=1)
    decode, prefill = graphs()
    assert decode["ready"] and (decode["batch"], decode["width"]) == (4, 8), decode
    # compiled here, or loaded from the package another test of this run stored (a load can round to 0.0 s)
    assert decode["cached"] in (True, False) and (decode["cached"] or decode["compile_s"] > 0), decode
    assert prefill["ready"] and prefill.get("prefill") and prefill["width"] == 32, prefill  # prefill_chunk
    r = post(server, "/generate", {"prompt": "def add(a, b):", "max_new_tokens": 20, "lookahead": "off"})
    assert r.status_code == 200, r.text
    tokens = r.json()["token_ids"]
    assert tokens == expected(local, "def add(a, b):", 20)
    decode_after, prefill_after = graphs()
    assert decode_after["calls"] >= decode["calls"] + len(tokens) - 1  # every decode step (the first token is prefill's)
    assert prefill_after["calls"] == prefill["calls"] + 1  # the prompt, one chunk
    # what its steps cost served beside what the graph cost alone (timed cell by cell while idle)
    assert decode_after["served_ms"]["b1t1"] > 0 and all(ms > 0 for ms in decode_after["alone_ms"].values())
    assert set(decode_after["alone_ms"]) <= {f"b{b}t{w}" for b in (1, 2, 4) for w in (1, 2, 3, 4, 6, 8)}


@pytest.mark.parametrize("lookahead", [{"n": 4, "w": 3, "g": 3}, {"n": 4, "w": 3, "g": 3, "adapt": False}])
def test_generate_matches_the_library(server, local, lookahead):
    r = post(server, "/generate", {"prompt": "def add(a, b):", "max_new_tokens": 20, "lookahead": lookahead})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["token_ids"] == expected(local, "def add(a, b):", 20)
    assert body["finish_reason"] in ("length", "eos")
    assert body["usage"] == {"prompt_tokens": len("def add(a, b):"), "completion_tokens": len(body["token_ids"])}
    assert body["lookahead"]["n"] == 4 and body["lookahead"]["steps"] >= 1
    for counts in body["lookahead"]["sources"].values():  # tree rows by source: what earns its rows
        assert 0 <= counts["accepted"] <= counts["proposed"]
    assert body["timings"]["total_ms"] >= body["timings"]["ttft_ms"] > 0
    assert body["text"] == local[1].decode(body["token_ids"], skip_special_tokens=True)


def test_a_response_does_not_tell_which_rows_came_from_other_requests_text(server):
    """The shared pool and history hold other requests' text: a response's `sources` leaves them
    out (report_replica_sources is off), while /health still counts them for the operator."""
    body = {"prompt": "for i in range(10):", "max_new_tokens": 32, "lookahead": {"n": 3, "w": 2, "g": 2}}
    seen = set()
    for _ in range(3):  # a repeat finds the first answer in the replica's history
        r = post(server, "/generate", body)
        assert r.status_code == 200, r.text
        seen |= set(r.json()["lookahead"]["sources"])
    assert not seen & {"shared", "history"}, seen
    rates = fresh_health(server)["history"]["row_acceptance"]["greedy"]
    assert set(rates) >= {"shared", "history"}


def test_generate_from_input_ids(server, local):
    ids = local[1]("x = 1\n")["input_ids"]
    body = post(server, "/generate", {"input_ids": ids, "max_new_tokens": 8, "lookahead": "off"}).json()
    assert body["token_ids"] == expected(local, "x = 1\n", 8) and body["lookahead"]["mode"] == "off"


def test_streaming_is_token_accurate(server, local):
    r = post(server, "/generate", {"prompt": "import os", "max_new_tokens": 16, "stream": True}, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    *chunks, done = sse.events(r.iter_lines())
    assert done == sse.DONE
    summary = chunks[-1]
    assert summary["done"] is True
    steps = [c for c in chunks[:-1] if c["token_ids"]]
    assert [t for c in steps for t in c["token_ids"]] == summary["token_ids"] == expected(local, "import os", 16)
    assert len(steps) == summary["lookahead"]["steps"]
    assert "".join(c["text"] for c in chunks[:-1]) == summary["text"]


def test_concurrent_requests_with_different_lookahead(server, local):
    cases = [("def f(x):", "off"), ("class A:", {"n": 3, "w": 2, "g": 2}), ("for i in", {"n": 5, "w": 4, "g": 4}),
             ("while True:", "auto"), ("return x", {"n": 2, "w": 1, "g": 1}), ("if a:", "auto")]

    def one(case):
        prompt, la = case
        return post(server, "/generate", {"prompt": prompt, "max_new_tokens": 24, "lookahead": la}).json()

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, cases))
    for (prompt, _), body in zip(cases, results):
        assert body["token_ids"] == expected(local, prompt, 24), prompt


def test_stop_strings_cut_the_text(server, local):
    full = post(server, "/generate", {"prompt": "abc", "max_new_tokens": 24, "lookahead": "off"}).json()
    text = full["text"]
    assert len(text) >= 4, "the fixture model must write a few characters for this test to pick a stop string"
    stop = text[2:4]
    cut = post(server, "/generate", {"prompt": "abc", "max_new_tokens": 24, "stop": [stop]}).json()
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(stop)]


def test_seeded_sampling_is_reproducible_and_follows_the_library(server, local):
    body = {"prompt": "def h(y):", "max_new_tokens": 16, "temperature": 0.9, "top_k": 20, "seed": 11, "lookahead": {"n": 3, "w": 2, "g": 3}}
    first, second = post(server, "/generate", body).json(), post(server, "/generate", body).json()
    assert first["token_ids"] == second["token_ids"]
    model, tok = local
    from lookahead_core import SamplingParams

    ids = torch.tensor([tok("def h(y):")["input_ids"]])
    lib = generate(model, ids, max_new_tokens=16, params=LookaheadParams(3, 2, 3), sampling=SamplingParams(0.9, top_k=20, seed=11))
    assert first["token_ids"] == lib.tokens
    other = post(server, "/generate", {**body, "seed": 12}).json()
    openai = post(server, "/v1/completions", {"prompt": "def h(y):", "max_tokens": 16, "temperature": 0.9, "top_k": 20, "seed": 11,
                                              "lookahead": {"n": 3, "w": 2, "g": 3}}).json()
    assert openai["choices"][0]["text"] == first["text"]
    assert other["token_ids"] != first["token_ids"] or len(first["token_ids"]) < 4


def test_a_seeded_request_returns_the_same_tokens_whatever_the_planner_and_the_load(server, local):
    """The server runs "auto": the planner's state (measured step costs, each request's pacing)
    moves with load. A seeded request's tokens depend on its seed alone: before a burst, after
    it, and eight at once, they equal plain sampling in the library."""
    body = {"prompt": "def h(y):", "max_new_tokens": 24, "temperature": 1.0, "seed": 42, "ignore_eos": True}
    first = post(server, "/generate", body).json()
    assert first["lookahead"]["mode"] == "auto"
    before = fresh_health(server)["step_costs_ms"]
    burst = [{"prompt": p, "max_new_tokens": 32, "lookahead": la} for p in ("abcabc", "for i in", "x = 1\n")
             for la in ("auto", {"n": 5, "w": 4, "g": 4, "adapt": False})]
    with ThreadPoolExecutor(6) as pool:
        assert all(r.status_code == 200 for r in pool.map(lambda b: post(server, "/generate", b), burst))
    assert fresh_health(server)["step_costs_ms"] != before  # the planner's costs moved
    again = post(server, "/generate", body).json()
    with ThreadPoolExecutor(8) as pool:
        together = [r.json() for r in pool.map(lambda _: post(server, "/generate", body), range(8))]
    model, tok = local
    from lookahead_core import SamplingParams

    plain = generate(model, torch.tensor([tok("def h(y):")["input_ids"]]), max_new_tokens=24, eos_token_id=[],
                     sampling=SamplingParams(1.0, seed=42)).tokens
    assert first["token_ids"] == again["token_ids"] == plain
    assert all(t["token_ids"] == plain for t in together)


def test_a_stop_string_cuts_the_token_ids_and_usage_as_plain_decoding_does(server):
    full = post(server, "/generate", {"prompt": "def add(a, b):", "max_new_tokens": 48, "ignore_eos": True,
                                      "lookahead": {"n": 4, "w": 3, "g": 3, "adapt": False}}).json()
    stop = full["text"][10:13]
    bodies = {la: {"prompt": "def add(a, b):", "max_new_tokens": 48, "ignore_eos": True, "stop": [stop], "lookahead": la}
              for la in ("off", "auto")}
    off, auto = (post(server, "/generate", b).json() for b in bodies.values())
    assert off["finish_reason"] == auto["finish_reason"] == "stop" and off["text"] == auto["text"]
    assert off["token_ids"] == auto["token_ids"] and off["usage"] == auto["usage"]
    assert off["usage"]["completion_tokens"] == len(off["token_ids"])


def test_openai_completions(server, local):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "def g():", "max_tokens": 12, "temperature": 0})
    body = r.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] <= 12
    assert body["choices"][0]["text"] == local[1].decode(expected(local, "def g():", 12), skip_special_tokens=True)
    r = post(server, "/v1/completions", {"prompt": "def g():", "max_tokens": 12, "stream": True, "temperature": 0}, stream=True)
    *chunks, done = sse.events(r.iter_lines())
    assert done == sse.DONE
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == body["choices"][0]["text"]


def test_openai_chat(server):
    body = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}).json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    stream_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True, "temperature": 0}
    r = post(server, "/v1/chat/completions", stream_body, stream=True)
    *chunks, done = sse.events(r.iter_lines())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"} and done == sse.DONE
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == body["choices"][0]["message"]["content"]


def test_chat_applies_the_configured_template(server, local):
    """The prompt is the chat template's rendering, not a hand-made transcript; /generate takes messages too."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    rendered = "<system>be brief\n<user>hi there\n<assistant>"
    want = expected(local, rendered, 8)
    body = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0}).json()
    assert body["usage"]["prompt_tokens"] == len(rendered)
    assert body["choices"][0]["message"]["content"] == local[1].decode(want, skip_special_tokens=True)
    native = post(server, "/generate", {"messages": messages, "max_new_tokens": 8}).json()
    assert native["token_ids"] == want and native["usage"]["prompt_tokens"] == len(rendered)
    # content as a list of text parts, as the OpenAI API allows (and GuideLLM sends)
    parts = [{"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
             {"role": "user", "content": [{"type": "text", "text": "hi there"}]}]
    as_parts = post(server, "/v1/chat/completions", {"messages": parts, "max_tokens": 8, "temperature": 0}).json()
    assert as_parts["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("/generate", "{not json", 422, "JSON"),
        ("/generate", {"prompt": 5}, 422, "prompt"),
        ("/generate", {"prompt": "x", "max_new_tokens": -1}, 422, "max_new_tokens"),
        ("/generate", {"prompt": "x", "max_new_tokens": "many"}, 422, "max_new_tokens"),
        ("/generate", {"prompt": "x", "max_new_tokens": 10**9}, 422, "max_new_tokens: Input should be less than or equal to 64"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 65}, 400, "max_tokens: Input should be less than or equal to 64"),
        ("/generate", {"prompt": "x" * 300, "max_new_tokens": 8}, 400, "the prompt has 300 tokens; this server accepts at most 255"),
        ("/generate", {"prompt": "x" * 200, "max_new_tokens": 64}, 400, "plus max_new_tokens=64 exceeds this engine's limit of 256"),
        ("/generate", {"prompt": "x", "lookahead": "fast"}, 422, "lookahead"),
        ("/generate", {"prompt": "x", "lookahead": {"n": 1, "w": 2, "g": 2}}, 422, "n must be >= 2"),
        ("/generate", {"prompt": "x", "lookahead": {"n": 3, "w": 2}}, 422, "exactly the keys n, w, g"),
        ("/generate", {"prompt": "x", "lookahead": {"n": 3, "w": 2, "g": 2, "adapt": "yes"}}, 422, "adapt must be a bool"),
        ("/generate", {"prompt": "x", "lookahead": {"n": 3, "w": 2, "g": 2, "fast": True}}, 422, "exactly the keys"),
        ("/generate", {"prompt": "x", "lookahead": {"n": 99, "w": 2, "g": 2}}, 422, "n=99 exceeds"),
        ("/generate", {"prompt": "x", "extra": 1}, 422, "extra"),
        ("/generate", {"max_new_tokens": 3}, 422, "exactly one of"),
        ("/generate", {"input_ids": [1, 5000], "max_new_tokens": 4}, 422, "input_ids.1: Input should be less than or equal to 127"),
        ("/generate", {"prompt": "x", "max_new_tokens": 4, "stop": ["a"] * 40}, 422, "stop: List should have at most 16 items"),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, "one prompt"),
        ("/v1/completions", {"prompt": "a", "temperature": 5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "a", "n": 17}, 400, "n: Input should be less than or equal to 16"),
        ("/v1/completions", {"prompt": [[1, 2], [3]]}, 400, "one prompt"),
        ("/v1/completions", {"prompt": "a", "logprobs": 6}, 400, "logprobs"),
        ("/generate", {"prompt": "x", "max_new_tokens": 4, "temperature": -1}, 422, "temperature"),
        ("/generate", {"prompt": "x", "max_new_tokens": 4, "temperature": 1, "top_p": 0}, 422, "top_p"),
        ("/generate", {"prompt": "x", "max_new_tokens": 4, "top_k": -1}, 422, "top_k"),
        ("/generate", {"prompt": "x", "max_new_tokens": 4, "seed": -5}, 422, "seed"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         400, "content part of type 'image_url' is not supported"),
        ("/generate", {"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, 422, "exactly one of"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         400, "`tools[0]` must be {\"type\": \"function\", \"function\": {\"name\": ...}}"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
         400, "`functions` is not supported by this server"),
        ("/v1/completions", {"prompt": "a", "model": "gpt-4o"}, 404, "the model `gpt-4o` does not exist"),
    ],
)
def test_bad_input_is_a_4xx_with_a_message(server, path, body, status, message):
    if isinstance(body, str):
        r = requests.post(server + path, data=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = post(server, path, body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/generate", {"max_new_tokens": 3}, 422, None, None),  # ServeRequest's rule, raised in the route
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "best_of": 2}, 400, "best_of",
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/generate", {"prompt": "x", "max_new_tokens": 65}, 422, "max_new_tokens", None),  # a bound of the body type
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, 400, "stop", None),
])
def test_a_refusal_names_its_field_and_code(server, path, body, status, param, code):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err

"""bench_structured's pure parts: the task set (its schemas cover what the issue asks, every example
validates), an answer's scoring, the stream read back, the figures and the issue's bars; no server
but a canned SSE one."""
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from jsonschema import Draft202012Validator

from benchmarks import bench_structured as bs


def schemas(node):
    """Every sub-schema of `node`, itself first."""
    yield node
    for child in (node.get("properties") or {}).values():
        yield from schemas(child)
    if isinstance(node.get("items"), dict):
        yield from schemas(node["items"])


def types(node) -> set[str]:
    t = node.get("type")
    return set(t) if isinstance(t, list) else {t} if t else set()


def test_tasks_load_and_every_example_validates():
    tasks = bs.read_tasks()
    assert len(tasks) >= 12 and len({t["name"] for t in tasks}) == len(tasks)
    for t in tasks:
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", t["name"])  # OpenAI's json_schema name
        assert t["prompt"].strip()
        Draft202012Validator.check_schema(t["schema"])
        assert bs.score(json.dumps(t["example"]), "stop", t["schema"]) == {
            "finish": "stop", "ended": True, "looped": False, "parses": True, "valid": True, "error": None}
    assert [t["name"] for t in bs.read_tasks(names=["order", "book"])] == ["book", "order"]  # the file's order
    with pytest.raises(SystemExit, match="no task named nope"):
        bs.read_tasks(names=["nope"])


def test_schemas_nest_arrays_enums_numbers_and_bound_most_strings():
    tasks = bs.read_tasks()
    free = set()
    for t in tasks:
        subs = list(schemas(t["schema"]))
        for s in subs:
            if "object" in types(s):  # closed objects, every property required
                assert s["additionalProperties"] is False and set(s["required"]) == set(s["properties"]), t["name"]
            if "string" in types(s) and not {"enum", "maxLength", "pattern"} & set(s):
                free.add(t["name"])
        kinds = set().union(*(types(s) for s in subs))
        assert {"object", "boolean"} <= kinds and kinds & {"integer", "number"}, t["name"]
        assert any("enum" in s for s in subs), t["name"]
    nested = [t for t in tasks if sum("object" in types(s) for s in schemas(t["schema"])) > 1]
    arrays = [t for t in tasks if any("array" in types(s) for s in schemas(t["schema"]))]
    assert len(nested) >= len(tasks) // 2 and len(arrays) >= len(tasks) // 2
    assert 2 <= len(free) <= len(tasks) // 3, free  # a few free strings, as real clients send


@pytest.mark.parametrize("text, finish, expect", [
    ('{"a": 1, "b": "x"}', "stop", {"ended": True, "parses": True, "valid": True, "error": None}),
    ('{"a": 1, "b": "xxxxxxxx', "length", {"looped": True, "parses": False, "valid": False}),
    ('{"a": 1, "b": "z"}', "stop", {"parses": True, "valid": False, "error": "invalid at /b: 'z' is not one of ['x', 'y']"}),
    ('{"a": 1, "b": "x", "c": 2}', "stop", {"valid": False}),
    ('{"a": 1}', "length", {"ended": False, "looped": True, "valid": False}),
])
def test_an_answer_is_scored_by_how_it_ended_parses_and_validates(text, finish, expect):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    got = bs.score(text, finish, schema)
    assert got["finish"] == finish and {k: got[k] for k in expect} == expect


def sse(*events) -> list[bytes]:
    return [f"data: {json.dumps(e)}".encode() if e != "[DONE]" else b"data: [DONE]" for e in events] + [b""]


CHUNKS = [{"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
          {"choices": [{"index": 0, "delta": {"content": '{"a": '}, "finish_reason": None}]},
          {"choices": [{"index": 0, "delta": {"content": '1, "b": "x"}'}, "finish_reason": None}]},
          {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
          {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}}, "[DONE]"]


def test_the_stream_gives_the_text_the_finish_and_a_summary_where_one_is_sent():
    assert bs.answer(sse(*CHUNKS)) == ('{"a": 1, "b": "x"}', "stop", None)
    summary = {"mode": "auto", "steps": 3, "compression": 2.33}
    assert bs.answer(sse(*CHUNKS[:4], {**CHUNKS[4], "lookahead": summary}, "[DONE]"))[2] == summary
    assert bs.answer(sse(CHUNKS[1], {"error": {"message": "gone"}}, CHUNKS[2])) == ('{"a": ', None, None)


@pytest.fixture()
def canned_server():
    """An OpenAI-shaped server streaming CHUNKS to every POST; the bodies it was sent."""
    bodies = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for line in sse(*CHUNKS):
                self.wfile.write(line + b"\n")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", bodies
    httpd.shutdown()
    httpd.server_close()


def test_a_task_is_sent_with_its_schema_timed_by_the_load_client_and_scored(canned_server):
    url, bodies = canned_server
    task = {"name": "ab", "prompt": "Give a and b.", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}}
    row = bs.run_task(url, task, "off", "m", 32)
    assert bodies[0]["response_format"] == bs.response_format(task) == {
        "type": "json_schema", "json_schema": {"name": "ab", "schema": task["schema"], "strict": True}}
    assert bodies[0]["lookahead"] == "off" and bodies[0]["max_tokens"] == 32 and bodies[0]["temperature"] == 0.0
    assert bodies[0]["stream"] and bodies[0]["messages"] == [{"role": "user", "content": "Give a and b."}]
    assert row["ok"] and row["tokens"] == 7 and row["valid"] and row["ended"] and row["text"] == '{"a": 1, "b": "x"}'
    assert 0 < row["ttft_s"] <= row["latency_s"] and "steps" not in row  # no summary, /health not read
    bs.run_task(url, task, None, "m", 32)  # vLLM: neither lookahead nor anything of ours
    bs.run_task(url, task, bs.CHAT, "m", 32)  # plain chat: no response_format, "auto"
    assert "lookahead" not in bodies[1] and bodies[1]["response_format"]["type"] == "json_schema"
    assert "response_format" not in bodies[2] and bodies[2]["lookahead"] == "auto"


def result(task, ok=True, tokens=10, latency=1.0, steps=None, **score):
    return {"task": task, "ok": ok, "error": None if ok else "boom", "tokens": tokens, "latency_s": latency,
            "ttft_s": 0.05, "tpot_s": 0.01, "text": "{}", **({"steps": steps, "steps_from": "health"} if steps else {}),
            **score}


def test_runs_are_summed_compared_and_held_to_the_issues_bars():
    good = {"finish": "stop", "ended": True, "looped": False, "parses": True, "valid": True}
    loop = {"finish": "length", "ended": False, "looped": True, "parses": False, "valid": False}
    bad = {"finish": "stop", "ended": True, "looped": False, "parses": True, "valid": False}
    results = {"ours-auto": [result("a", tokens=30, latency=1.0, steps=10, **good), result("b", tokens=30, latency=1.0, steps=15, **loop)],
               "ours-off": [result("a", tokens=30, latency=2.0, steps=30, **good), result("b", tokens=30, latency=2.0, steps=30, **loop)],
               "ours-chat": [result("a", tokens=20, latency=1.0, steps=5, finish="stop", ended=True),
                             result("b", ok=False)],
               "vllm": [result("a", tokens=30, latency=5.0, **bad), result("b", tokens=30, latency=5.0, **loop)]}
    rows = {k: bs.summarize(k, v) for k, v in results.items()}
    a = rows["ours-auto"]
    assert (a["tokens_per_s"], a["tokens_per_step"], a["valid"], a["ended"], a["looped"]) == (30.0, 2.4, 1, 1, 1)
    assert rows["ours-chat"]["errors"] == 1 and rows["ours-chat"]["tokens_per_step"] == 4.0
    assert rows["vllm"]["tokens_per_step"] is None and rows["vllm"]["ended_invalid"] == 1
    assert bs.ratios(rows, 2) == ["auto/off tok/s 2.00x", "auto/vLLM tok/s 5.00x, e2e p50 0.20x, TTFT p50 1.00x",
                                  "off/vLLM tok/s 2.50x", "valid: ours-auto 1/2, ours-off 1/2, vllm 0/2",
                                  "tokens per step, auto: schema tasks 2.40, the same prompts as plain chat 4.00"]
    assert bs.identical(results) == "auto and off answers identical: 2/2" and bs.identical({"vllm": []}) is None
    checks = bs.checks(rows, 2)
    assert checks[:5] == ["PASS every answer of ours that ended by itself validates (0 did not, over ours-auto, ours-off)",
                          "PASS ours-auto valid 1/2 >= vLLM's 0/2", "PASS ours-off valid 1/2 >= vLLM's 0/2",
                          "PASS auto/off tok/s 2.00x >= 1.3x", "PASS auto/vLLM tok/s 5.00x >= 2.5x"]
    assert "looped to max_tokens: vllm 1/2" in checks
    results["ours-off"][0].update(bad)
    assert bs.checks({k: bs.summarize(k, v) for k, v in results.items()}, 2)[0].startswith("FAIL every answer of ours")
    lines = bs.per_task(results, [{"name": "a"}, {"name": "b"}])
    assert lines[0].startswith("a ") and "ours-auto: stop valid 30 tok 3.00/step" in lines[0] and "vllm: stop INVALID" in lines[0]

"""The OpenAI API as the official `openai` SDK uses it, against the session's real Serve app."""
import json
import re
import shutil

import openai
import pytest
import requests
from tokenizers import decoders

from tests.conftest import TINY_CHAT_TEMPLATE
from tests.fixtures import wait_until
from tests.lookahead_core.helpers import char_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]
# The random model writes random arguments: a bounded city, and no other property, lets every call end within its budget.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_list_and_retrieve(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model" and model.created > 0
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.code == "model_not_found" and "gpt-4o" in err.value.message


def test_chat_completion(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == "tiny" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    u = r.usage
    assert 0 < u.completion_tokens <= 8 and u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_max_completion_tokens_limits_chat(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_chat_stream_with_include_usage(client):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == whole.usage.model_dump()
    summary = last.model_extra["lookahead"]  # the lookahead summary, as the whole body carries it
    assert summary["mode"] == whole.model_extra["lookahead"]["mode"] and summary["steps"] >= 1
    assert set(summary) == set(whole.model_extra["lookahead"])
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None and c.object == "chat.completion.chunk" for c in body)
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == whole.choices[0].message.content
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stream_without_include_usage_sends_no_usage(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True))
    assert chunks and all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_completions_streamed_and_not(client):
    whole = client.completions.create(model="tiny", prompt="def g():", max_tokens=12, temperature=0)
    u = whole.usage
    assert whole.object == "text_completion" and u.total_tokens == u.prompt_tokens + u.completion_tokens
    chunks = list(client.completions.create(model="tiny", prompt="def g():", max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text


def test_stop_as_a_string(client):
    full = client.completions.create(model="tiny", prompt="abc", max_tokens=24, temperature=0).choices[0].text
    assert len(full) >= 4, "the fixture model must write a few characters for this test to pick a stop string"
    stop = full[2:4]
    cut = client.completions.create(model="tiny", prompt="abc", max_tokens=24, temperature=0, stop=stop).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


@pytest.mark.parametrize("chat", [True, False])
def test_unknown_model_is_not_found(client, chat):
    with pytest.raises(openai.NotFoundError) as err:
        if chat:
            client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
        else:
            client.completions.create(model="gpt-4o", prompt="x", max_tokens=4, stream=True)
    assert err.value.param == "model" and err.value.code == "model_not_found"
    assert err.value.type == "invalid_request_error" and "gpt-4o" in err.value.message


def test_tools_are_a_chats_and_refused_on_completions_by_name(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"tools": [WEATHER]})
    assert err.value.param == "tools" and err.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as err:  # a bad tool is named by the chat route
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                       tools=[{"type": "function", "function": {"name": "get weather"}}])
    assert err.value.param == "tools" and "must match" in err.value.message


@pytest.mark.parametrize("chat, field, value", [
    (True, "tool_choice", "auto"),  # without tools
    (True, "functions", [{"name": "f"}]),
    (True, "function_call", "auto"),
    (True, "echo", True),
    (False, "best_of", 2),
    (False, "suffix", "}"),
])
def test_unsupported_fields_are_refused_by_name(client, chat, field, value):
    err = refused(client, chat, {field: value})
    assert f"`{field}`" in err.message and err.param == field


def refused(client, chat: bool, extra: dict) -> openai.BadRequestError:
    """The SDK's error for a chat (or completion) with `extra` in its body."""
    with pytest.raises(openai.BadRequestError) as err:
        if chat:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body=extra)
        else:
            client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
    return err.value


@pytest.mark.parametrize("chat, field, value", [
    (True, "response_format", {"type": "xml"}),
    (True, "logit_bias", {"abc": 10}),
    (True, "presence_penalty", 3),
    (False, "stop_token_ids", [-1]),
    (False, "structured_outputs", {"choice": []}),
])
def test_bad_values_of_the_logits_options_and_structured_output_are_refused_by_name(client, chat, field, value):
    assert refused(client, chat, {field: value}).param == field


def test_the_logits_options_are_served(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, presence_penalty=0.5,
                                       frequency_penalty=-1, logit_bias={"5": 10},
                                       extra_body={"repetition_penalty": 1.1, "min_p": 0.05, "min_tokens": 2,
                                                   "stop_token_ids": [3]})
    assert r.usage.completion_tokens >= 1


def test_default_values_of_unsupported_fields_are_accepted(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=1, presence_penalty=0,
                                       frequency_penalty=0.0, logprobs=False, tool_choice="none", user="someone",
                                       response_format={"type": "text"})
    assert r.usage.completion_tokens >= 1
    r = client.completions.create(model="tiny", prompt="x", max_tokens=4, echo=False, best_of=1, n=1, logprobs=None)
    assert r.usage.completion_tokens >= 1


def test_stream_options_need_stream(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, stream_options={"include_usage": True})
    assert err.value.param == "stream_options"


# Prompts after which the tiny fixture model (greedy) writes EOS (token 1) as its n-th token.
@pytest.mark.parametrize("chat, prompt, eos_after", [(False, "K", 9), (True, "*", 11)])
def test_ignore_eos_decodes_to_max_tokens(client, chat, prompt, eos_after):
    def create(**extra):
        if chat:
            return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                  max_completion_tokens=20, temperature=0, **extra)
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, **extra)

    early = create()  # precondition: without ignore_eos the model stops at EOS well before 20 tokens
    assert early.usage.completion_tokens == eos_after and early.choices[0].finish_reason == "stop"
    r = create(extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 20 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("method, path, body, status, param", [
    ("post", "/generate", {"prompt": 5}, 422, "prompt"),
    ("post", "/generate", {"prompt": "x" * 300, "max_new_tokens": 8}, 400, None),
    ("post", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("post", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("get", "/v1/nowhere", None, 404, None),
])
def test_every_error_is_the_openai_envelope(server, method, path, body, status, param):
    r = requests.request(method, server + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json().keys() == {"error"}
    err = r.json()["error"]
    assert err.keys() == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param


def test_completion_logprobs_are_the_models(client):
    r = client.completions.create(model="tiny", prompt="def g():", max_tokens=10, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert " ".join(lp.tokens) == choice.text  # the tiny word-level tokenizer decodes with spaces between tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # alternatives whose text is the same (ids the tiny tokenizer has no piece for) share a key
        assert value <= 0 and 1 <= len(top) <= 4 and top[tok] == value
        assert value == max(top.values())  # greedy: the chosen token is the most likely


def test_completion_echo_with_prompt_logprobs_and_token_id_prompts(client):
    r = client.completions.create(model="tiny", prompt="abcd", max_tokens=2, temperature=0, logprobs=1, echo=True,
                                  extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.text.startswith("abcd") and len(choice.logprobs.tokens) == 4 + 2
    assert choice.logprobs.tokens[:4] == list("abcd")
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(v <= 0 for v in choice.logprobs.token_logprobs[1:])
    # the same prompt as token ids (how lm-eval sends it) gives the same numbers
    ids = client.completions.create(model="tiny", prompt=[[ord(c) for c in "abcd"]], max_tokens=2, temperature=0,
                                    logprobs=1, echo=True, extra_body={"ignore_eos": True}).choices[0]
    assert ids.logprobs.tokens == choice.logprobs.tokens
    assert ids.logprobs.token_logprobs[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)


def test_chat_logprobs_with_top_alternatives(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=5, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and " ".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 5 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert c.bytes == list(c.token.encode())
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)


def test_streamed_logprobs_equal_the_whole(client):
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True,
              "top_logprobs": 2, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [c for chunk in chunks for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in whole]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in whole], abs=1e-5)


def test_n_choices_with_their_own_seeds(client):
    kwargs = {"model": "tiny", "prompt": "abc", "max_tokens": 8, "temperature": 1.0, "seed": 7,
              "extra_body": {"ignore_eos": True}}
    r = client.completions.create(**kwargs, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 3 * 8
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1  # independent seed streams
    assert texts[0] == client.completions.create(**kwargs).choices[0].text  # choice 0 uses the seed itself
    streamed = list(client.completions.create(**kwargs, n=3, stream=True, stream_options={"include_usage": True}))
    by_index = {i: "".join(c.choices[0].text for c in streamed[:-1] if c.choices[0].index == i) for i in range(3)}
    assert list(by_index.values()) == texts and streamed[-1].usage.completion_tokens == 24


def test_chat_n_choices(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].message.content == r.choices[1].message.content


@pytest.mark.parametrize("kwargs, param", [
    ({"logprobs": 6}, "logprobs"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"best_of": 2}, "best_of"),
])
def test_completion_bounds_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="abc", max_tokens=2, **kwargs)
    assert err.value.param == param


@pytest.mark.parametrize("kwargs, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"extra_body": {"echo": True}}, "echo"),
])
def test_chat_logprob_rules_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **kwargs)
    assert err.value.param == param


def test_continuous_usage_stats_count_up_in_every_chunk(client):
    """vLLM's extension, which GuideLLM sends with every streamed request."""
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_completion_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None and c.choices]
    assert counts and counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6



# ---- tools ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tools_client(server, tiny_model_dir, tmp_path_factory):
    """The tiny model in an app of its own: a context that holds the tools' system turn (the session's holds 256
    tokens), and its character tokenizer writing text as the model wrote it (no space between tokens: JSON parses)."""
    from ray import serve

    from deployments.app import build_app

    path = tmp_path_factory.mktemp("tiny-tools-model")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    tok = char_tokenizer()
    tok.backend_tokenizer.decoder = decoders.Fuse()
    tok.save_pretrained(path)
    args = {"model": {"path": str(path), "name": "tiny", "dtype": "float32", "chat_template": TINY_CHAT_TEMPLATE},
            "engine": {"max_batch": 4, "max_seq_len": 1024, "max_new_tokens": 256, "prefill_chunk": 128}, "num_cpus": 0}
    serve.run(build_app(args), name="tools", route_prefix="/tools")
    url = server + "/tools"
    wait_until(lambda: requests.get(url + "/health", timeout=5).status_code == 200, 120, interval=0.5)
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    serve.delete("tools")


def _assembled(chunks) -> dict[int, dict]:
    """Each choice's content, calls and finish from a stream, put together as SDK users do: calls by their index."""
    got: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            choice = got.setdefault(c.index, {"content": "", "calls": {}, "finish": None})
            choice["content"] += c.delta.content or ""
            choice["finish"] = c.finish_reason or choice["finish"]
            for tc in c.delta.tool_calls or ():
                call = choice["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
    return got


def _is_weather(name: str, arguments: str) -> bool:
    return name == "get_weather" and isinstance(json.loads(arguments)["city"], str)


def test_a_required_call_then_its_result_answered(tools_client):
    r = tools_client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=200,
                                             temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and _is_weather(call.function.name, call.function.arguments)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens > 400  # the tools in the system turn
    # the answer sent back as the SDK gives it, the result as a tool turn; then tools offered none, or none at all
    chat = [*ASK, choice.message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    for tools in ({"tools": [WEATHER], "tool_choice": "none"}, {}):
        a = tools_client.chat.completions.create(model="tiny", messages=chat, max_tokens=16, temperature=0, **tools).choices[0]
        assert a.finish_reason in ("stop", "length") and isinstance(a.message.content, str) and not a.message.tool_calls


def test_a_required_call_streamed(tools_client):
    kwargs = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 200,
              "temperature": 0}
    whole = tools_client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    [streamed] = _assembled(tools_client.chat.completions.create(**kwargs, stream=True)).values()
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    calls = [streamed["calls"][i] for i in sorted(streamed["calls"])]
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in whole]
    assert all(c["id"].startswith("call_") and _is_weather(c["name"], c["arguments"]) for c in calls)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_call_for_each_of_n_choices(tools_client, stream):
    r = tools_client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice=NAMED, n=2,
                                             max_tokens=200, temperature=0.7, seed=3, stream=stream)
    if stream:
        got = _assembled(r)
        assert sorted(got) == [0, 1] and all(c["finish"] == "tool_calls" and len(c["calls"]) == 1 for c in got.values())
        assert all(_is_weather(call["name"], call["arguments"]) for c in got.values() for call in c["calls"].values())
    else:
        assert [c.index for c in r.choices] == [0, 1] and all(c.finish_reason == "tool_calls" for c in r.choices)
        assert all(len(c.message.tool_calls) == 1 and _is_weather(c.message.tool_calls[0].function.name,
                                                                   c.message.tool_calls[0].function.arguments) for c in r.choices)


def test_auto_reads_the_same_content_streamed_and_whole(tools_client):
    """Under "auto" the model may answer or call: the random one answers; its text reads the same either way."""
    kwargs = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "max_tokens": 32, "temperature": 0}
    whole = tools_client.chat.completions.create(**kwargs).choices[0]
    [streamed] = _assembled(tools_client.chat.completions.create(**kwargs, stream=True)).values()
    assert (streamed["content"] or None, streamed["finish"]) == (whole.message.content or None, whole.finish_reason)
    assert len(streamed["calls"]) == len(whole.message.tool_calls or ())


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank", "tags"],
          "properties": {"city": {"type": "string", "maxLength": 8}, "rank": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["old", "new"]}, "maxItems": 2}}}


@pytest.mark.parametrize("lookahead", ["auto", "off"])
def test_a_json_schema_answer_parses_and_matches_its_schema(tools_client, lookahead):
    """The random model's answer under response_format: json_schema ends by itself and holds the
    schema, whole and streamed, with lookahead and without; the text it forces is the same both ways."""
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0, response_format=fmt,
                  extra_body={"lookahead": lookahead})
    whole = tools_client.chat.completions.create(**kwargs).choices[0]
    streamed = _assembled(tools_client.chat.completions.create(**kwargs, stream=True))[0]
    for text, finish in ((whole.message.content, whole.finish_reason), (streamed["content"], streamed["finish"])):
        value = json.loads(text)
        assert finish == "stop" and list(value) == ["city", "rank", "tags"], text
        assert len(value["city"]) <= 8 and isinstance(value["rank"], int) and set(value["tags"]) <= {"old", "new"}
    assert streamed["content"] == whole.message.content


def test_structured_outputs_regex_and_choice_on_completions(tools_client):
    regex = tools_client.completions.create(model="tiny", prompt="code:", max_tokens=20, temperature=0,
                                            extra_body={"structured_outputs": {"regex": "[A-F]{3}-[0-9]{2}"}}).choices[0]
    assert re.fullmatch("[A-F]{3}-[0-9]{2}", regex.text) and regex.finish_reason == "stop"
    choice = tools_client.completions.create(model="tiny", prompt="pick:", max_tokens=20, temperature=0.8, seed=3,
                                             extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert choice.choices[0].text in ("red", "green", "blue")

"""The OpenAI API as the official `openai` SDK uses it, against the session's real Serve app."""
import openai
import pytest
import requests

MESSAGES = [{"role": "user", "content": "hi"}]


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


def test_tools_are_refused_by_name(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, tools=[tool])
    assert "`tools` is not supported by this server" in err.value.message
    assert err.value.param == "tools" and err.value.code == "unsupported_parameter"


@pytest.mark.parametrize("chat, field, value", [
    (True, "tool_choice", "auto"),
    (True, "functions", [{"name": "f"}]),
    (True, "function_call", "auto"),
    (True, "response_format", {"type": "json_object"}),
    (True, "logit_bias", {"5": 10}),
    (True, "presence_penalty", 0.5),
    (True, "frequency_penalty", -1),
    (True, "echo", True),
    (False, "best_of", 2),
    (False, "suffix", "}"),
])
def test_unsupported_fields_are_refused_by_name(client, chat, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        if chat:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body={field: value})
        else:
            client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={field: value})
    assert f"`{field}`" in err.value.message and err.value.param == field


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

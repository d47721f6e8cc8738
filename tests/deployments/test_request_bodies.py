"""HTTP bodies become one ServeRequest; the OpenAI fields are mapped there. No Ray needed."""
import re

import pytest
from pydantic import ValidationError

from deployments.request_bodies import ChatRequest, CompletionRequest, GenerateRequest
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams
from lookahead_core.serving import Message, RequestError


def test_generate_body_to_request():
    req = GenerateRequest(prompt="x", max_new_tokens=7, stop=["a"], lookahead={"n": 4, "w": 3, "g": 3},
                          temperature=0.5, top_k=3, seed=2, timeout_s=9).to_request()
    assert (req.prompt, req.max_new_tokens, req.stop, req.timeout_s) == ("x", 7, ("a",), 9)
    assert req.lookahead == LookaheadParams(4, 3, 3) and req.sampling == SamplingParams(0.5, 3, 1.0, 2)
    greedy = GenerateRequest(input_ids=[1, 2], lookahead="off").to_request()
    assert greedy.sampling is None and greedy.input_ids == (1, 2) and greedy.mode == "off"


def test_openai_fields_are_mapped():
    c = CompletionRequest(prompt=["hi"], max_tokens=None, stop="!", ignore_eos=True).to_request()
    assert (c.prompt, c.max_new_tokens, c.stop, c.ignore_eos) == ("hi", 16, ("!",), True)
    assert c.sampling == SamplingParams(1.0)  # OpenAI's default temperature
    chat = ChatRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                       max_tokens=5, max_completion_tokens=3, temperature=0).to_request()
    assert chat.messages == (Message("user", "ab"),) and chat.max_new_tokens == 3 and chat.sampling is None
    assert ChatRequest(messages=[{"role": "user", "content": "x"}], max_tokens=5).to_request().max_new_tokens == 5
    assert ChatRequest(messages=[{"role": "user", "content": "x"}]).to_request().max_new_tokens is None  # the server's default


@pytest.mark.parametrize("model, body, message", [
    (GenerateRequest, {"prompt": "x", "lookahead": {"n": 1, "w": 2, "g": 2}}, "lookahead n must be >= 2"),
    (GenerateRequest, {"prompt": "x", "top_p": 0}, "top_p must be in (0, 1]"),
    (GenerateRequest, {"input_ids": [3, -1]}, "greater than or equal to 0"),
    (CompletionRequest, {"prompt": "a", "temperature": 3}, "temperature"),
])
def test_shapes_and_bounds_are_validation_errors_from_their_one_place(model, body, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        model.model_validate(body)


@pytest.mark.parametrize("model, body, status, param, code, message", [
    (GenerateRequest, {"prompt": ""}, 422, "prompt", None, "`prompt` must not be empty"),
    (GenerateRequest, {}, 422, None, None, "exactly one of"),
    (GenerateRequest, {"prompt": "x", "max_new_tokens": 0}, 422, "max_new_tokens", None, "max_new_tokens"),
    (ChatRequest, {"messages": []}, 400, "messages", None, "`messages` must not be empty"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs", None,
     "`top_logprobs` needs `logprobs: true`"),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo", "unsupported_parameter",
     "`echo` is not supported"),
    (CompletionRequest, {"prompt": ["a", "b"]}, 400, "prompt", None, "one prompt per request"),
    (CompletionRequest, {"prompt": "a", "best_of": 2}, 400, "best_of", "unsupported_parameter",
     "`best_of` (other than 1) is not supported"),
    (CompletionRequest, {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options", None,
     "only allowed when `stream` is true"),
])
def test_a_refusal_is_the_request_error_to_request_raises_not_a_validation_error(model, body, status, param, code, message):
    """The body's shape is valid, so validating it passes; the route's `to_request` raises the
    RequestError the client gets (status, param, code), with no pydantic error in between."""
    valid = model.model_validate(body)
    with pytest.raises(RequestError, match=re.escape(message)) as err:
        valid.to_request()
    assert (err.value.status, err.value.param, err.value.code) == (status, param, code)


def test_a_lookahead_setting_of_3_0_is_the_integer_3_as_json_schema_reads_it():
    params = GenerateRequest(prompt="x", lookahead={"n": 3.0, "w": 2, "g": 2.0}).to_request().params
    assert params is not None and (params.n, params.w, params.g) == (3, 2, 2) and isinstance(params.n, int)
    with pytest.raises(ValidationError, match="lookahead n must be an integer, got 3.5"):
        GenerateRequest(prompt="x", lookahead={"n": 3.5, "w": 2, "g": 2})

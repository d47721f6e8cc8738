"""ServeRequest: the prompt and type rules, checked once; (N, W, G) and sampling stay their own classes'."""
import pickle

import pytest

from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams
from lookahead_core.serving import Message, RequestError, ServeRequest


def test_defaults_and_normalisation():
    req = ServeRequest(input_ids=[3, 4], stop=["a"], messages=None)
    assert req.input_ids == (3, 4) and req.stop == ("a",) and req.mode == "auto" and req.params is None
    assert len(req.request_id) == 32 and ServeRequest(prompt="x").request_id != req.request_id
    chat = ServeRequest(messages=[{"role": "user", "content": "hi"}], stop="x")
    assert chat.messages == (Message("user", "hi"),) and chat.stop == ("x",)
    fixed = ServeRequest(prompt="x", lookahead=LookaheadParams(4, 3, 3), sampling=SamplingParams(0.5, seed=1))
    assert fixed.mode == "fixed" and fixed.params == LookaheadParams(4, 3, 3)
    assert ServeRequest(prompt="x", lookahead="off").mode == "off"
    assert pickle.loads(pickle.dumps(fixed)) == fixed


@pytest.mark.parametrize("kwargs, param, message", [
    ({}, None, "give exactly one of"),
    ({"prompt": "x", "input_ids": [1]}, None, "give exactly one of"),
    ({"prompt": ""}, "prompt", "`prompt` must not be empty"),
    ({"input_ids": []}, "input_ids", "`input_ids` must not be empty"),
    ({"messages": []}, "messages", "`messages` must not be empty"),
    ({"input_ids": [1, True]}, "input_ids", "list of integers"),
    ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens", ">= 1"),
    ({"prompt": "x", "stop": [1]}, "stop", "list of strings"),
    ({"prompt": "x", "lookahead": "fast"}, "lookahead", "`lookahead` must be"),
    ({"prompt": "x", "lookahead": {"n": 3, "w": 2, "g": 2}}, "lookahead", "`lookahead` must be"),
    ({"prompt": "x", "sampling": {"temperature": 1}}, "sampling", "SamplingParams or None"),
    ({"prompt": "x", "timeout_s": 0}, "timeout_s", "> 0"),
])
def test_bad_requests_name_their_field(kwargs, param, message):
    with pytest.raises(RequestError, match=message) as err:
        ServeRequest(**kwargs)
    assert err.value.status == 400 and err.value.param == param

"""Bodies bounded by the server's limits: validation enforces each limit and the JSON schema
(what FastAPI serves) states it, from the one field constraint. No Ray needed."""
import re

import pytest
from pydantic import ValidationError

from deployments.bounded_bodies import bounded_bodies, decimals_up_to
from deployments.request_bodies import ChatRequest, GenerateRequest
from lookahead_core.engine.config import EngineConfig
from lookahead_core.serving import RequestLimits

ENGINE = EngineConfig(max_new_tokens=64, max_n=5, max_w=6, max_g=7)
LIMITS = RequestLimits(max_stop_strings=2, max_stop_chars=8)
BODIES = bounded_bodies("tiny", 128, ENGINE, LIMITS)
CHAT = {"messages": [{"role": "user", "content": "x"}]}


def props(body) -> dict:
    return body.model_json_schema()["properties"]


def test_the_bodies_keep_their_names_fields_and_rules():
    assert [b.__name__ for b in (BODIES.generate, BODIES.completion, BODIES.chat)] == \
        ["GenerateRequest", "CompletionRequest", "ChatRequest"]
    assert issubclass(BODIES.generate, GenerateRequest) and issubclass(BODIES.chat, ChatRequest)
    assert BODIES.completion.model_validate({"prompt": "x"}).max_tokens == 16  # the base field's default
    assert props(BODIES.chat)["max_tokens"]["description"] == props(ChatRequest)["max_tokens"]["description"]
    with pytest.raises(ValidationError, match="greater than or equal to 1"):  # the base field's own bound
        BODIES.completion.model_validate({"prompt": "x", "max_tokens": 0})


def test_the_schema_states_the_limits():
    gen, completion, chat = props(BODIES.generate), props(BODIES.completion), props(BODIES.chat)
    assert gen["input_ids"]["anyOf"][0]["items"] == {"type": "integer", "minimum": 0, "maximum": 127}
    assert completion["prompt"]["anyOf"][1]["items"]["maximum"] == 127  # token ids, alone or in a list of one
    assert completion["prompt"]["anyOf"][3]["items"]["items"]["maximum"] == 127
    for budget in (gen["max_new_tokens"], completion["max_tokens"], chat["max_tokens"], chat["max_completion_tokens"]):
        assert budget["anyOf"][0]["maximum"] == 64
    for least in (gen["min_tokens"], completion["min_tokens"], chat["min_tokens"]):  # never more than a budget
        assert (least["anyOf"][0]["minimum"], least["anyOf"][0]["maximum"]) == (0, 64)
    nwg = gen["lookahead"]["anyOf"][1]["properties"]
    assert (nwg["n"]["maximum"], nwg["w"]["maximum"], nwg["g"]["maximum"]) == (5, 6, 7) and nwg["n"]["minimum"] == 2
    assert gen["stop"]["maxItems"] == 2 and gen["stop"]["items"] == {"type": "string", "minLength": 1, "maxLength": 8}
    assert chat["stop"]["anyOf"][0] == {"type": "string", "minLength": 1, "maxLength": 8}
    assert chat["model"]["anyOf"][0] == {"type": "string", "enum": ["tiny"]}
    for body in (gen, completion, chat):  # token ids the request names, within the vocabulary
        assert body["stop_token_ids"]["anyOf"][0]["items"] == {"type": "integer", "minimum": 0, "maximum": 127}
        bias = body["logit_bias"]["anyOf"][0]
        assert bias["propertyNames"] == {"pattern": decimals_up_to(127)} and bias["maxProperties"] == 1024
        assert bias["additionalProperties"] == {"type": "number", "minimum": -100, "maximum": 100}
    # LogitRules' and SamplingParams' bounds, stated
    assert (chat["presence_penalty"]["minimum"], chat["presence_penalty"]["maximum"]) == (-2, 2)
    assert (gen["repetition_penalty"]["exclusiveMinimum"], gen["repetition_penalty"]["maximum"]) == (0, 100)
    assert (completion["min_p"]["minimum"], completion["min_p"]["maximum"]) == (0, 1)


def test_the_key_pattern_takes_the_token_ids_up_to_the_largest():
    for top in (*range(0, 130), 999, 1000, 49151, 151935):
        pattern = re.compile(decimals_up_to(top))
        assert all(bool(pattern.fullmatch(str(n))) == (n <= top) for n in range(min(10 * top + 20, 200_000))), top
        assert not any(pattern.fullmatch(key) for key in ("", "00", "01", "-1", "1.0", " 1"))


@pytest.mark.parametrize("body, fields, message", [
    ("generate", {"input_ids": [1, 128]}, "less than or equal to 127"),
    ("completion", {"prompt": [[1, 128]]}, "less than or equal to 127"),
    ("generate", {"prompt": "x", "max_new_tokens": 65}, "less than or equal to 64"),
    ("chat", {**CHAT, "max_completion_tokens": 65}, "less than or equal to 64"),
    ("completion", {"prompt": "x", "min_tokens": 65}, "less than or equal to 64"),
    ("generate", {"prompt": "x", "lookahead": {"n": 3, "w": 7, "g": 2}}, "lookahead w=7 exceeds this engine's limit of 6"),
    ("generate", {"prompt": "x", "stop": ["a", "b", "c"]}, "at most 2 items"),
    ("chat", {**CHAT, "stop": "abcdefghi"}, "at most 8 characters"),
    ("completion", {"prompt": "x", "stop": [""]}, "at least 1 character"),
    ("chat", {**CHAT, "stop_token_ids": [5, 128]}, "less than or equal to 127"),
    ("generate", {"prompt": "x", "logit_bias": {"3": 1, "128": -1}}, "logit_bias names token 128, beyond the vocabulary"),
])
def test_validation_enforces_the_limits(body, fields, message):
    bounded = getattr(BODIES, body)
    with pytest.raises(ValidationError, match=message):
        bounded.model_validate(fields)
    bounded.__base__.model_validate(fields)  # the unbounded body leaves the limit to the server


def test_the_limits_at_their_edge_are_served():
    BODIES.generate.model_validate({"input_ids": [0, 127], "max_new_tokens": 64, "stop": ["a" * 8, "b"],
                                    "lookahead": {"n": 5, "w": 6, "g": 7}}).to_request()
    BODIES.chat.model_validate({**CHAT, "stop": "a" * 8, "model": "tiny"}).to_request()


def test_without_stop_strings_a_single_stop_string_is_refused():
    chat = bounded_bodies("tiny", 128, ENGINE, RequestLimits(max_stop_strings=0)).chat
    assert chat.model_validate({**CHAT, "stop": []}).to_request().stop == ()
    with pytest.raises(ValidationError, match="stop"):
        chat.model_validate({**CHAT, "stop": "a"})
    assert [branch["type"] for branch in props(chat)["stop"]["anyOf"]] == ["array", "null"]


def test_an_unknown_model_is_left_to_the_route_as_a_404():
    assert BODIES.completion.model_validate({"prompt": "x", "model": "gpt-4o"}).model == "gpt-4o"

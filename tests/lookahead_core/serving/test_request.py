"""ServeRequest: the prompt and type rules, checked once; (N, W, G) and sampling stay their own classes'."""
import dataclasses
import pickle

import pytest

from lookahead_core.constraints.grammar import GrammarSpec
from lookahead_core.constraints.logit_rules import LogitRules
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams
from lookahead_core.serving import Message, RequestError, ServeRequest
from lookahead_core.serving.tools import ToolChoice, parse_tools, tool_grammar


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
    assert (req.rules, req.grammar, req.grammar_field, req.stop_token_ids) == (None, None, "grammar", ())


def test_logits_options_grammar_and_stop_token_ids():
    rules, grammar = LogitRules(presence_penalty=0.5, logit_bias={7: -3.0}, min_tokens=2), GrammarSpec.choice(["yes", "no"])
    req = ServeRequest(prompt="x", rules=rules, grammar=grammar, grammar_field="response_format", stop_token_ids=[5, 9])
    assert (req.rules, req.grammar, req.grammar_field, req.stop_token_ids) == (rules, grammar, "response_format", (5, 9))
    assert pickle.loads(pickle.dumps(req)) == req  # across the Serve hop
    # all neutral: no rules, so that the engine keeps its unconstrained path
    assert ServeRequest(prompt="x", rules=LogitRules(repetition_penalty=1.0)).rules is None
    assert ServeRequest(prompt="x", grammar=grammar, ignore_eos=False).grammar == grammar


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
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", "integers >= 0"),
    ({"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids", "integers >= 0"),
    ({"prompt": "x", "stop_token_ids": 3}, "stop_token_ids", "list of token ids"),
    ({"prompt": "x", "rules": {"presence_penalty": 1}}, "rules", "LogitRules or None"),
    ({"prompt": "x", "grammar": "a+", "grammar_field": "structured_outputs"}, "structured_outputs", "GrammarSpec or None"),
    # a grammar that is done leaves only the end: decoding past it cannot follow the grammar
    ({"prompt": "x", "grammar": GrammarSpec("regex", "a+"), "grammar_field": "response_format", "ignore_eos": True},
     "ignore_eos", "`ignore_eos` cannot be combined with `response_format`"),
])
def test_bad_requests_name_their_field(kwargs, param, message):
    with pytest.raises(RequestError, match=message) as err:
        ServeRequest(**kwargs)
    assert err.value.status == 400 and err.value.param == param


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = parse_tools([WEATHER])
CHAT = [{"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]


def test_a_chat_carries_its_tools_and_calls_and_a_forced_choice_its_grammar():
    req = ServeRequest(messages=CHAT, tools=TOOLS, tool_choice=ToolChoice("auto"))
    assert req.messages[1] == Message("assistant", None, (CHAT[1]["tool_calls"][0],)) and req.messages[2].tool_call_id == "call_1"
    assert [m.to_dict() for m in req.messages] == CHAT and req.grammar is None  # "auto": the model decides, unconstrained
    assert (req.tools, req.tool_choice) == (TOOLS, ToolChoice("auto")) and pickle.loads(pickle.dumps(req)) == req
    for choice in (ToolChoice("required"), ToolChoice("function", "get_weather")):
        forced = ServeRequest(messages=CHAT, tools=TOOLS, tool_choice=choice)
        assert (forced.grammar, forced.grammar_field) == (tool_grammar(TOOLS, choice), "tool_choice")
        assert dataclasses.replace(forced, n=1) == forced  # derived once: a choice of n keeps it
    assert ServeRequest(messages=CHAT, tools=TOOLS).tool_choice == ToolChoice("none")  # the typed default: no calls


@pytest.mark.parametrize("kwargs, param, message", [
    ({"prompt": "x", "tools": TOOLS}, "tools", "for a chat"),
    ({"messages": CHAT, "tools": [WEATHER]}, "tools", "must be ToolSpecs"),
    ({"messages": CHAT, "tool_choice": ToolChoice("auto")}, "tool_choice", "offers none of `tools`"),
    ({"messages": CHAT, "tools": TOOLS, "tool_choice": ToolChoice("function", "get_time")}, "tool_choice", "offers none"),
    ({"messages": CHAT, "tools": TOOLS, "tool_choice": "required"}, "tool_choice", "offers none"),
    ({"messages": CHAT, "tools": TOOLS, "tool_choice": ToolChoice("required"), "grammar": GrammarSpec("json_object"),
      "grammar_field": "response_format"}, "tool_choice", r"a forced `tool_choice` \(required\) cannot be combined with `response_format`"),
    ({"messages": CHAT, "tools": TOOLS, "tool_choice": ToolChoice("function", "get_weather"), "ignore_eos": True},
     "ignore_eos", "`ignore_eos` cannot be combined with `tool_choice`"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages", "chat turns"),
])
def test_bad_tools_name_their_field(kwargs, param, message):
    with pytest.raises(RequestError, match=message) as err:
        ServeRequest(**kwargs)
    assert err.value.status == 400 and err.value.param == param

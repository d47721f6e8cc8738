"""HTTP bodies become one ServeRequest; the OpenAI fields are mapped there. No Ray needed."""
import re

import pytest
from pydantic import ValidationError

from deployments.request_bodies import UNSUPPORTED, ChatRequest, CompletionRequest, GenerateRequest
from lookahead_core.constraints.grammar import GrammarSpec
from lookahead_core.constraints.logit_rules import LogitRules
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams
from lookahead_core.serving import Message, RequestError
from lookahead_core.serving.tools import ToolChoice, parse_tools, tool_grammar


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


CHAT = {"messages": [{"role": "user", "content": "x"}]}
OPTIONS = {"repetition_penalty": 1.2, "presence_penalty": -0.5, "frequency_penalty": 2, "logit_bias": {"7": -100, "12": 3.5},
           "min_tokens": 4, "stop_token_ids": [3, 9], "min_p": 0.1, "temperature": 0.7}


@pytest.mark.parametrize("model, prompt", [(GenerateRequest, {"prompt": "x"}), (CompletionRequest, {"prompt": "x"}),
                                           (ChatRequest, CHAT)])
def test_the_logits_options_and_stop_token_ids_are_mapped_alike_on_every_route(model, prompt):
    req = model.model_validate({**prompt, **OPTIONS}).to_request()
    assert req.rules == LogitRules(1.2, -0.5, 2.0, ((7, -100.0), (12, 3.5)), 4)
    assert req.stop_token_ids == (3, 9) and req.sampling == SamplingParams(0.7, min_p=0.1)
    assert req.grammar is None
    plain = model.model_validate({**prompt, "temperature": 0, "min_p": 0.5, "presence_penalty": None}).to_request()
    assert plain.sampling is None and plain.rules is None and plain.stop_token_ids == ()  # greedy ignores min_p


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("model, body, field, grammar", [
    (ChatRequest, {"response_format": {"type": "text"}}, "grammar", None),
    (ChatRequest, {"response_format": {"type": "json_object"}}, "response_format", GrammarSpec("json_object")),
    (CompletionRequest, {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True,
                                                                                   "description": "an a"}}},
     "response_format", GrammarSpec.json_schema(SCHEMA)),
    (ChatRequest, {"structured_outputs": {"json": SCHEMA}}, "structured_outputs", GrammarSpec.json_schema(SCHEMA)),
    (GenerateRequest, {"structured_outputs": {"json": '{"type": "object"}'}}, "structured_outputs",
     GrammarSpec("json", '{"type": "object"}')),
    (GenerateRequest, {"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs", GrammarSpec("regex", "[0-9]+")),
    (CompletionRequest, {"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs", GrammarSpec.choice(["yes", "no"])),
    (ChatRequest, {"structured_outputs": {"grammar": 'root ::= "a"'}}, "structured_outputs", GrammarSpec("grammar", 'root ::= "a"')),
    (GenerateRequest, {"structured_outputs": {"json_object": True}}, "structured_outputs", GrammarSpec("json_object")),
    (ChatRequest, {"response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     GrammarSpec("regex", "a")),
    # vLLM's older fields, as clients written before structured_outputs send them
    (ChatRequest, {"guided_json": SCHEMA}, "guided_json", GrammarSpec.json_schema(SCHEMA)),
    (CompletionRequest, {"guided_regex": "a+"}, "guided_regex", GrammarSpec("regex", "a+")),
    (ChatRequest, {"guided_choice": ["a", "b"]}, "guided_choice", GrammarSpec.choice(["a", "b"])),
    (ChatRequest, {"guided_grammar": 'start: "a"'}, "guided_grammar", GrammarSpec("grammar", 'start: "a"')),
])
def test_a_grammar_comes_from_one_field_which_its_errors_name(model, body, field, grammar):
    prompt = CHAT if model is ChatRequest else {"prompt": "x"}
    req = model.model_validate({**prompt, **body}).to_request()
    assert (req.grammar, req.grammar_field) == (grammar, field)


@pytest.mark.parametrize("model, body, field, message", [
    (ChatRequest, {"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    (ChatRequest, {"logit_bias": {"-1": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    (CompletionRequest, {"logit_bias": {"5": 200}}, "logit_bias", "logit_bias[5] must be in [-100, 100]"),
    (GenerateRequest, {"presence_penalty": 3}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
    (ChatRequest, {"frequency_penalty": -2.5}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
    (ChatRequest, {"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be in (0, 100]"),
    (GenerateRequest, {"min_tokens": -1}, "min_tokens", "min_tokens must be an integer"),
    (ChatRequest, {"stop_token_ids": [-1]}, "stop_token_ids", "greater than or equal to 0"),
    (CompletionRequest, {"min_p": 2}, "min_p", "min_p must be in [0, 1]"),
    (ChatRequest, {"response_format": {"type": "xml"}}, "response_format", "does not match any of the expected tags"),
    (ChatRequest, {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format",
     "Field required"),
    (ChatRequest, {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}}, "response_format",
     "valid dictionary"),
    (GenerateRequest, {"structured_outputs": {"json_object": False}}, "structured_outputs", "Input should be True"),
    (ChatRequest, {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "Extra inputs"),
])
def test_a_bad_option_is_a_validation_error_naming_its_field(model, body, field, message):
    prompt = CHAT if model is ChatRequest else {"prompt": "x"}
    with pytest.raises(ValidationError, match=re.escape(message)) as err:
        model.model_validate({**prompt, **body})
    assert err.value.errors()[0]["loc"][0] == field  # the routes' `param`


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
    (ChatRequest, {**CHAT, "structured_outputs": {"choice": []}}, 400, "structured_outputs", None,
     "choice must be a non-empty list of strings"),
    (GenerateRequest, {"prompt": "x", "structured_outputs": {"regex": ""}}, 422, "structured_outputs", None,
     "the regex grammar is empty"),
    (GenerateRequest, {"prompt": "x", "structured_outputs": {}}, 422, "structured_outputs", None,
     "takes exactly one of json, regex, choice, grammar, json_object, got none"),
    (ChatRequest, {**CHAT, "structured_outputs": {"regex": "a", "grammar": "b"}}, 400, "structured_outputs", None,
     "got regex, grammar"),
    (ChatRequest, {**CHAT, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, 400,
     "structured_outputs", None, "give at most one of `response_format`, `structured_outputs`"),
    (CompletionRequest, {"prompt": "a", "guided_regex": "a", "structured_outputs": {"regex": "b"}}, 400,
     "structured_outputs", None, "give at most one of `guided_regex`, `structured_outputs`"),
    (ChatRequest, {**CHAT, "guided_json": 5}, 400, "guided_json", None, "`guided_json`: Input should be a valid dictionary"),
    (ChatRequest, {**CHAT, "guided_choice": []}, 400, "guided_choice", None, "choice must be a non-empty list"),
    (ChatRequest, {**CHAT, "response_format": {"type": "json_object"}, "ignore_eos": True}, 400, "ignore_eos", None,
     "`ignore_eos` cannot be combined with `response_format`"),
    (GenerateRequest, {"prompt": "x", "structured_outputs": {"regex": "a"}, "ignore_eos": True}, 422, "ignore_eos", None,
     "`ignore_eos` cannot be combined with `structured_outputs`"),
    # tools are a chat's: OpenAI's completions take none
    (CompletionRequest, {"prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools",
     "unsupported_parameter", "`tools` is not supported"),
    (CompletionRequest, {"prompt": "a", "tool_choice": "auto"}, 400, "tool_choice", "unsupported_parameter",
     "`tool_choice` (other than \"none\") is not supported"),
    (ChatRequest, {**CHAT, "tools": [{"type": "function", "function": {"name": "get weather"}}]}, 400, "tools", None,
     "`tools[0]`: a function's name must match"),
    (ChatRequest, {**CHAT, "tools": {"type": "function"}}, 400, "tools", None, "`tools` must be a list"),
    (ChatRequest, {**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, 400,
     "tool_choice", None, "`tool_choice` names 'get_time', which is not among `tools`"),
    (ChatRequest, {**CHAT, "tool_choice": "required"}, 400, "tool_choice", None, "`tool_choice` 'required' needs `tools`"),
    (ChatRequest, {**CHAT, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, 400,
     "tool_choice", None, "a forced `tool_choice` (required) cannot be combined with `response_format`"),
    (ChatRequest, {**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                   "structured_outputs": {"regex": "a"}}, 400, "tool_choice",
     None, "a forced `tool_choice` (get_weather) cannot be combined with `structured_outputs`"),
    (ChatRequest, {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/x"}}}],
                   "tool_choice": "required"}, 400, "tools", None, "the tools' parameters make no grammar"),
    (CompletionRequest, {"prompt": "a", "functions": [{"name": "f"}]}, 400, "functions", "unsupported_parameter",
     "`functions` is not supported"),
    (ChatRequest, {**CHAT, "function_call": "auto"}, 400, "function_call", "unsupported_parameter",
     "`function_call` (other than \"none\") is not supported"),
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


def test_the_options_once_refused_are_fields_now_and_functions_stay_refused():
    assert {"functions", "function_call", "best_of", "suffix"} <= set(UNSUPPORTED) and not {"tools", "tool_choice"} & set(UNSUPPORTED)
    served = {"response_format", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
              "min_tokens", "stop_token_ids"}
    assert not served & set(UNSUPPORTED) and served <= set(ChatRequest.model_fields)
    assert served - {"response_format"} <= set(GenerateRequest.model_fields)  # /generate: structured_outputs
    # "off" values were accepted before and still are
    off = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {}, "presence_penalty": 0}
    assert ChatRequest.model_validate({**CHAT, **off}).to_request().rules is None


TURNS = [{"role": "user", "content": "Weather in Oslo?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.mark.parametrize("tool_choice, choice", [
    (None, ToolChoice("auto")), ("auto", ToolChoice("auto")), ("none", ToolChoice("none")), ("required", ToolChoice("required")),
    ({"type": "function", "function": {"name": "get_weather"}}, ToolChoice("function", "get_weather")),
])
def test_a_chats_tools_and_tool_choice_are_mapped_and_a_forced_choice_is_its_grammar(tool_choice, choice):
    body = {"messages": TURNS, "tools": [WEATHER], **({} if tool_choice is None else {"tool_choice": tool_choice})}
    req = ChatRequest.model_validate(body).to_request()
    assert req.tools == parse_tools([WEATHER]) and req.tool_choice == choice
    if choice.forced:
        assert (req.grammar, req.grammar_field) == (tool_grammar(req.tools, choice), "tool_choice")
    else:
        assert req.grammar is None


def test_a_chat_sends_back_calls_and_their_results():
    """OpenAI's shapes as the SDK sends them back: an assistant's calls with content null (or absent), a tool's result."""
    sent = [*TURNS, {"role": "assistant", "tool_calls": [{**TURNS[1]["tool_calls"][0], "index": 0}], "refusal": None}]
    req = ChatRequest.model_validate({"messages": sent}).to_request()
    assert [m.to_dict() for m in req.messages] == [*TURNS, {**TURNS[1]}]
    assert req.messages[1] == Message("assistant", None, tuple(TURNS[1]["tool_calls"])) and req.tools == ()
    with pytest.raises(ValidationError) as err:  # a call needs its function's name
        ChatRequest.model_validate({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}]})
    assert err.value.errors()[0]["loc"][0] == "messages"
    # the schema states what the template's turns refuse: calls are an assistant's
    schema = ChatRequest.model_json_schema()["$defs"]["ChatMessage"]
    assert schema["dependentSchemas"]["tool_calls"]["anyOf"][1] == {"properties": {"role": {"const": "assistant"}}}


def test_generate_takes_no_tools():
    with pytest.raises(ValidationError) as err:
        GenerateRequest.model_validate({"messages": TURNS, "tools": [WEATHER]})
    assert err.value.errors()[0]["loc"][0] == "tools"

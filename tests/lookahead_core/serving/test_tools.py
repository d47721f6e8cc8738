"""Tool calls without a model: the 400s name their field, the grammar takes the calls it should and only those (and
they parse), the chat renders for templates with and without tools."""
import json
import re

import jinja2
import llguidance
import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from lookahead_core.serving import RequestError
from lookahead_core.serving.tool_calls import parse_tool_calls
from lookahead_core.serving.tools import (
    AUTO_RULE,
    MAX_TOOLS,
    REQUIRED_RULE,
    ToolChoice,
    ToolSpec,
    parse_tool_choice,
    parse_tools,
    render_tool_prompt,
    template_takes_tools,
    template_turns,
    tool_grammar,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"$ref": "#/$defs/n"}}, "required": ["a", "b"],
    "$defs": {"n": {"type": "integer"}}}}}  # pydantic writes $defs: their $refs must resolve inside the call
ANY = {"type": "function", "function": {"name": "ping"}}  # no parameters: any object
TOOLS = parse_tools([WEATHER, ADD, ANY])
AUTO, REQUIRED, NONE = ToolChoice("auto"), ToolChoice("required"), ToolChoice("none")
NAMED = ToolChoice("function", "get_weather")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
                 "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                 "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
                 "{% if m.role == 'tool' %}(from {{ m.name }} for {{ m.tool_call_id }}){% endif %}|{% endfor %}")


# ---- tools and tool_choice ----------------------------------------------------------------------------------------

def test_tools_parse_into_specs():
    assert parse_tools(None) == () and parse_tools([]) == ()
    weather, add, ping = TOOLS
    assert weather == ToolSpec("get_weather", "The weather in a city", WEATHER["function"]["parameters"], False)
    assert ping.parameters is None and ping.openai() == {
        "type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
    assert weather.openai() == WEATHER and hash(weather) == hash(parse_tools([WEATHER])[0])
    strict = {"type": "function", "function": {"name": "s", "strict": True, "description": None}}
    assert parse_tools([strict])[0].strict and not parse_tools([{"type": "function", "function": {"name": "s", "strict": None}}])[0].strict
    assert len(parse_tools([{"type": "function", "function": {"name": f"t{i}"}} for i in range(MAX_TOOLS)])) == MAX_TOOLS


def _fn(**function):
    return {"type": "function", "function": function}


@pytest.mark.parametrize("raw, message", [
    ({"type": "function"}, "must be a list"),
    ("get_weather", "must be a list"),
    ([_fn(name=f"t{i}") for i in range(MAX_TOOLS + 1)], f"at most {MAX_TOOLS}"),
    ([{"type": "retrieval", "function": {"name": "x"}}], r"`tools\[0\]` must be"),
    ([{"type": "function"}], r"`tools\[0\]` must be"),
    ([WEATHER, {"type": "function", "function": "add"}], r"`tools\[1\]` must be"),
    (["add"], r"`tools\[0\]` must be"),
    ([_fn(description="no name")], "name must match"),
    ([_fn(name="get weather")], "name must match"),
    ([_fn(name="x" * 65)], "name must match"),
    ([_fn(name="")], "name must match"),
    ([_fn(name=3)], "name must match"),
    ([WEATHER, ADD, WEATHER], r"`tools\[2\]`: two tools are named 'get_weather'"),
    ([_fn(name="f", parameters=[{"type": "object"}])], "`parameters` must be a JSON schema object"),
    ([_fn(name="f", parameters="{}")], "`parameters` must be a JSON schema object"),
    ([_fn(name="f", description=3)], "`description` must be a string"),
    ([_fn(name="f", strict="yes")], "`strict` must be a boolean"),
])
def test_bad_tools_name_the_field(raw, message):
    with pytest.raises(RequestError, match=message) as err:
        parse_tools(raw)
    assert err.value.status == 400 and err.value.param == "tools"


def test_tool_choice_parses():
    assert parse_tool_choice(None, TOOLS) == AUTO and parse_tool_choice(None, ()) == NONE
    assert parse_tool_choice("none", TOOLS) == NONE and parse_tool_choice("none", ()) == NONE
    assert parse_tool_choice("auto", TOOLS) == AUTO and parse_tool_choice("required", TOOLS) == REQUIRED
    assert parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, TOOLS) == NAMED
    assert NAMED.forced and REQUIRED.forced and not AUTO.forced and not NONE.forced
    assert NAMED.offered(TOOLS) == [TOOLS[0]] and AUTO.offered(TOOLS) == list(TOOLS) and NONE.offered(TOOLS) == []


@pytest.mark.parametrize("raw, tools, message", [
    ("auto", (), "needs `tools`"),
    ("required", (), "needs `tools`"),
    ({"type": "function", "function": {"name": "get_weather"}}, (), "needs `tools`"),
    ("any", TOOLS, "must be \"none\", \"auto\", \"required\" or"),
    ({"type": "function", "function": {"name": "get_time"}}, TOOLS, "names 'get_time', which is not among `tools`"),
    ({"type": "function", "name": "get_weather"}, TOOLS, "must be"),
    ({"type": "tool", "function": {"name": "get_weather"}}, TOOLS, "must be"),
    (["auto"], TOOLS, "must be"),
])
def test_bad_tool_choice_names_the_field(raw, tools, message):
    with pytest.raises(RequestError, match=message) as err:
        parse_tool_choice(raw, tools)
    assert err.value.status == 400 and err.value.param == "tool_choice"


# ---- the grammar ----------------------------------------------------------------------------------------------------

class _Bytes:
    """A tokenizer of one token per byte, for llguidance: a grammar's language checked text by text."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]

    def __call__(self, text):
        return list(text)


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def _matches(spec, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, spec.llguidance(), log_level=0)
    ids = list(text.encode())
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def test_no_grammar_unless_forced():
    assert tool_grammar(TOOLS, AUTO) is None and tool_grammar(TOOLS, NONE) is None


def test_named_grammar_takes_one_call_of_that_function():
    spec = tool_grammar(TOOLS, NAMED)
    assert spec.kind == "json" and llguidance.LLMatcher.validate_grammar(spec.llguidance()) == ""
    good = ['{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}']
    bad = ['{"name": "add", "arguments": {"a": 1, "b": 2}}',                     # another tool
           '{"name": "get_weather", "arguments": {"days": 3}}',                   # a required argument missing
           '{"name": "get_weather", "arguments": {"city": 3}}',                   # of the wrong type
           '{"name": "get_weather", "arguments": {"city": "x", "wind": true}}',   # the schema's additionalProperties
           '{"name": "get_weather"}', '{"arguments": {"city": "x"}, "name": "get_weather"}',  # "name" comes first
           '{"name": "get_weather", "arguments": {"city": "x"}, "id": 1}', '[{"name": "get_weather", "arguments": {"city": "x"}}]',
           '{"name": "get_weather", "arguments": {"city": "Paris"}', 'Sure! {"name": "get_weather", "arguments": {"city": "x"}}']
    assert all(_matches(spec, t) for t in good) and not any(_matches(spec, t) for t in bad)
    for text in good:  # what the grammar takes parses
        content, calls = parse_tool_calls(text, NAMED, TOOLS)
        assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", json.loads(text)["arguments"])]


def test_required_grammar_takes_an_array_of_calls_of_any_tool():
    spec = tool_grammar(TOOLS, REQUIRED)
    good = ['[{"name": "add", "arguments": {"a": 1, "b": 2}}]',
            '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "ping", "arguments": {"anything": [1, null]}}]',
            '[{"name": "ping", "arguments": {}}, {"name": "ping", "arguments": {}}, {"name": "add", "arguments": {"a": 0, "b": -4}}]']
    bad = ['[]', '{"name": "ping", "arguments": {}}', '[{"name": "add", "arguments": {"a": "1", "b": 2}}]',  # $defs' integer
           '[{"name": "get_time", "arguments": {}}]', '[{"name": "ping", "arguments": []}]', 'I will call add.']
    assert all(_matches(spec, t) for t in good) and not any(_matches(spec, t) for t in bad)
    for text in good:
        content, calls = parse_tool_calls(text, REQUIRED, TOOLS)
        assert content is None and [(c.name, json.loads(c.arguments), c.index) for c in calls] == [
            (o["name"], o["arguments"], i) for i, o in enumerate(json.loads(text))]


def test_parameters_that_make_no_grammar_are_a_400_naming_tools():
    broken = parse_tools([_fn(name="f", parameters={"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}})])
    assert tool_grammar(broken, AUTO) is None  # unforced: nothing to build
    for choice in (REQUIRED, ToolChoice("function", "f")):
        with pytest.raises(RequestError, match="make no grammar") as err:
            tool_grammar(broken, choice)
        assert err.value.status == 400 and err.value.param == "tools"


# ---- rendering ------------------------------------------------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and 2+3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "5"},
    {"role": "assistant", "content": "Sunny; 5.", "tool_calls": [
        {"id": "call_3", "type": "function", "function": {"name": "ping", "arguments": "not json"}}]},
    {"role": "tool", "tool_call_id": "call_3", "content": "pong"},
    {"role": "user", "content": "Thanks"},
]


def test_template_takes_tools_reads_its_text():
    assert template_takes_tools(TOOL_TEMPLATE) and not template_takes_tools(CHATML) and not template_takes_tools(None)
    assert template_takes_tools({"default": CHATML, "tool_use": TOOL_TEMPLATE}) and not template_takes_tools({"default": CHATML})


def test_plain_template_gets_a_system_prompt_and_flat_turns():
    turns, kwargs = render_tool_prompt(False, CHAT, TOOLS, AUTO)
    assert kwargs == {} and all(set(t) == {"role", "content"} and isinstance(t["content"], str) for t in turns)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user", "assistant", "user", "user"]
    system = turns[0]["content"]
    assert system.startswith("Be brief.\n\n") and system.endswith(AUTO_RULE) and system.count("system") == 0
    listed = re.search(r"<tools>\n(.*)\n</tools>", system, re.S).group(1).split("\n")
    assert [json.loads(line) for line in listed] == [t.openai() for t in TOOLS]
    assert turns[2]["content"] == ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
                                   '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert turns[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n5\n</tool_response>"
    assert turns[4]["content"] == 'Sunny; 5.\n<tool_call>{"name": "ping", "arguments": "not json"}</tool_call>'
    text = jinja2.Template(CHATML).render(messages=turns, add_generation_prompt=True)
    assert text.count("<|im_start|>system") == 1 and text.endswith("<|im_start|>assistant\n")
    # what the model is asked to write parses back into the calls it was shown
    content, calls = parse_tool_calls(turns[2]["content"], AUTO, TOOLS)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city":"Paris"}'), ("add", '{"a":2,"b":3}')]


def test_plain_template_system_turn_is_added_and_forced_choices_say_so():
    chat = [{"role": "user", "content": "hi"}]
    turns, _ = render_tool_prompt(False, chat, TOOLS, REQUIRED)
    assert turns[0]["role"] == "system" and turns[0]["content"].endswith(REQUIRED_RULE) and AUTO_RULE not in turns[0]["content"]
    assert turns[1:] == chat and chat == [{"role": "user", "content": "hi"}]  # the request's own turns untouched
    named, _ = render_tool_prompt(False, chat, TOOLS, NAMED)
    assert '"get_weather"' in named[0]["content"] and '"add"' not in named[0]["content"]  # the named function alone
    assert named[0]["content"].endswith('reply only with {"name": "get_weather", "arguments": <JSON object>}.')
    assert render_tool_prompt(False, chat, TOOLS, NONE) == (chat, {})  # "none": no tools offered
    assert render_tool_prompt(False, [{"role": "system", "content": ""}, *chat], TOOLS, AUTO)[0][0]["content"].startswith("You may")


def test_tool_template_gets_tools_and_structured_turns():
    turns, kwargs = render_tool_prompt(True, CHAT, TOOLS, AUTO)
    assert kwargs == {"tools": [t.openai() for t in TOOLS]} and turns[0] == CHAT[0]
    assert turns[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    assert turns[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"}
    assert turns[5]["tool_calls"][0]["function"]["arguments"] == "not json" and len(turns) == len(CHAT)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), unk_token="<unk>")
    tokenizer.chat_template = TOOL_TEMPLATE
    text = tokenizer.apply_chat_template(turns, tokenize=False, **kwargs)
    assert text.startswith("<tools>get_weather;add;ping;</tools><system>Be brief.|")
    assert '[call call_2 add {"a": 2, "b": 3}]' in text and "<tool>5(from add for call_2)|" in text
    forced, kwargs = render_tool_prompt(True, CHAT[1:2], TOOLS, NAMED)
    assert kwargs == {"tools": [TOOLS[0].openai()]} and forced[0]["role"] == "system" and "<tools>" not in forced[0]["content"]
    assert render_tool_prompt(True, CHAT[1:2], TOOLS, AUTO) == (CHAT[1:2], {"tools": [t.openai() for t in TOOLS]})


@pytest.mark.parametrize("turn", [
    {"content": "no role"},
    "user: hi",
    {"role": "user", "content": 3},
    {"role": "user", "content": "hi", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "assistant", "content": None, "tool_calls": {"id": "1"}},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {"arguments": "{}"}}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": 1, "type": "function", "function": {"name": "f"}}]},
    {"role": "assistant", "content": None, "tool_calls": ["f()"]},
    {"role": "tool", "content": "5", "tool_call_id": 7},
])
def test_bad_turns_name_messages(turn):
    for takes_tools in (False, True):
        with pytest.raises(RequestError, match=r"`messages\[1\]` must be a chat turn") as err:
            template_turns([{"role": "user", "content": "hi"}, turn], takes_tools)
        assert err.value.status == 400 and err.value.param == "messages"

"""The calls read from a model's output: the stream reads an output as the whole-text parse does, never raising on it."""
import random
import re

import pytest

from lookahead_core.serving.outputs import ToolCall
from lookahead_core.serving.tool_calls import ToolCallStream, finish_reason, parse_tool_calls

from .test_tools import AUTO, NAMED, NONE, REQUIRED, TOOLS

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
AUTO_CASES = [  # text, content, [(name, arguments)]
    ("Just text, no call.\n", "Just text, no call.\n", []),
    ("", "", []),
    ("  \n", "  \n", []),
    ("a <b> is not <tool_call", "a <b> is not <tool_call", []),
    (CALL, None, [("get_weather", '{"city":"Paris"}')]),
    ("\n" + CALL + "\n\n", None, [("get_weather", '{"city":"Paris"}')]),
    ("Let me look.\n" + CALL, "Let me look.", [("get_weather", '{"city":"Paris"}')]),
    ("Both:\n" + CALL + "\n" + ADD_CALL + "\nDone.  ", "Both:\n\n\nDone.", [("get_weather", '{"city":"Paris"}'), ("add", '{"a":1,"b":2}')]),
    (CALL + ADD_CALL, None, [("get_weather", '{"city":"Paris"}'), ("add", '{"a":1,"b":2}')]),
    (BROKEN := '<tool_call>{"name": "add", "arguments": {"a": 1, </tool_call> ok', BROKEN, []),
    (UNKNOWN := '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', UNKNOWN, []),
    (LIST := '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', LIST, []),
    (LIST + ADD_CALL, LIST, [("add", '{"a":1,"b":2}')]),
    (NAN := '<tool_call>{"name": "add", "arguments": {"a": NaN}}</tool_call>', NAN, []),
    ('<tool_call>{"name": "ping", "parameters": {"x": "é"}}</tool_call>', None, [("ping", '{"x":"é"}')]),
    ('<tool_call>{"name": "ping", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("ping", '{"x":1}')]),
    ('<tool_call>{"name": "ping"}</tool_call>', None, [("ping", "{}")]),
    (ODD := '<tool_call>{"name": ["ping"], "arguments": {}}</tool_call>', ODD, []),
    (DEEP := "<tool_call>" + "[" * 20_000 + "]" * 20_000 + "</tool_call>", DEEP, []),
    (OPEN := 'Calling.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b"', OPEN, []),  # cut short
    (ADD_CALL + '\n<tool_call>{"name": "add"', '\n<tool_call>{"name": "add"', [("add", '{"a":1,"b":2}')]),  # an open block
]


def _read(text, choice, chunks):
    """`text` fed to a stream in `chunks`: its content, its calls as (name, arguments), and the events."""
    stream = ToolCallStream(choice, TOOLS)
    events = [e for chunk in chunks for e in stream.feed(chunk)] + stream.finish()
    calls = [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)]
    assert [e.index for e in events if isinstance(e, ToolCall)] == list(range(len(calls))) and stream.calls == [
        e for e in events if isinstance(e, ToolCall)]
    return "".join(e for e in events if isinstance(e, str)), calls, events


@pytest.mark.parametrize("text, content, calls", AUTO_CASES)
def test_auto_parse_and_stream(text, content, calls):
    got, made = parse_tool_calls(text, AUTO, TOOLS)
    assert got == content and [(c.name, c.arguments) for c in made] == calls
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in made) and len({c.id for c in made}) == len(made)
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(1, len(text)), min(5, max(len(text) - 1, 0)))) if len(text) > 1 else []
    for chunks in ([text[i] for i in range(len(text))], [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])], [text]):
        streamed, streamed_calls, _ = _read(text, AUTO, chunks)
        assert streamed == (content or "") and streamed_calls == calls


def test_stream_holds_back_only_what_may_begin_a_tag():
    stream = ToolCallStream(AUTO, TOOLS)
    assert stream.feed("Hello <tool") == ["Hello"]  # the space held as trailing whitespace, "<tool" as a tag's start
    assert stream.feed("box> and ") == [" <toolbox> and"]
    assert stream.feed("<") == [] and stream.feed("tool_call>{\"name\": \"ping\"") == []
    [call] = stream.feed(', "arguments": {}}</tool_call>')
    assert isinstance(call, ToolCall) and call.delta() == {"index": 0, "id": call.id, "type": "function",
                                                           "function": {"name": "ping", "arguments": "{}"}}
    assert stream.feed("  ") == [] and stream.finish() == []  # a call was made: trailing whitespace dropped
    assert finish_reason(stream.calls, "stop") == "tool_calls"


FORCED_CASES = [  # choice, text, content, [(name, arguments)]
    (NAMED, '{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [("get_weather", '{"city":"Paris"}')]),
    (NAMED, '{"name": "get_weather", "arguments": {"city": "Pa', '{"name": "get_weather", "arguments": {"city": "Pa', []),  # cut short
    (NAMED, '{"name": "add", "arguments": {"a": 1, "b": 2}}', '{"name": "add", "arguments": {"a": 1, "b": 2}}', []),  # not the named
    (REQUIRED, '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "ping", "arguments": {}}]', None,
     [("add", '{"a":1,"b":2}'), ("ping", "{}")]),
    (REQUIRED, CUT := '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "pi', CUT, []),
    (REQUIRED, '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "rm", "arguments": {}}]',
     '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "rm", "arguments": {}}]', []),  # all the calls or none
    (REQUIRED, "[]", "[]", []),
    (REQUIRED, '{"name": "ping", "arguments": {}}', '{"name": "ping", "arguments": {}}', []),
    (REQUIRED, "", "", []),
]


@pytest.mark.parametrize("choice, text, content, calls", FORCED_CASES)
def test_forced_parse_and_stream(choice, text, content, calls):
    got, made = parse_tool_calls(text, choice, TOOLS)
    assert got == content and [(c.name, c.arguments) for c in made] == calls
    streamed, streamed_calls, _ = _read(text, choice, list(text))
    assert streamed == (content or "") and streamed_calls == calls


def test_none_choice_reads_no_calls():
    text = "Sure. " + CALL + " "
    assert parse_tool_calls(text, NONE, TOOLS) == (text, [])
    streamed, calls, _ = _read(text, NONE, list(text))
    assert streamed == text and calls == []


def test_calls_shapes_and_finish_reason():
    call = ToolCall("add", '{"a":1}', 2, "call_x")
    assert call.openai() == {"id": "call_x", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}
    assert call.delta() == {"index": 2, **call.openai()}
    assert finish_reason([call], "stop") == "tool_calls" and finish_reason([call], "eos") == "tool_calls"
    assert finish_reason([call], "length") == "length" and finish_reason([], "stop") == "stop"

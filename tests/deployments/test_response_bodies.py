"""Response bodies in OpenAI's vocabulary, whole and streamed. No Ray needed."""
import asyncio

from deployments.response_bodies import OPENAI_FINISH, openai_body
from deployments.streaming import openai_events
from lookahead_core.lookahead.stopping import FinishReason
from lookahead_core.serving import Completion, Delta, LookaheadSummary, Timings, Usage, sse
from lookahead_core.serving.outputs import ToolCall


def test_every_finish_reason_has_an_openai_name():
    assert set(OPENAI_FINISH) == set(FinishReason) and OPENAI_FINISH["abort"] == "abort"


HEAD = {"id": "chatcmpl-x", "created": 1, "model": "tiny"}
WEATHER = ToolCall("get_weather", '{"city":"Oslo"}', 0, "call_a")
TIME = ToolCall("get_time", "{}", 1, "call_b")


def _done(text, reason=FinishReason.EOS, calls=(), index=0, tokens=5):
    return Completion(text, tuple(range(tokens)), reason, Usage(3, tokens), LookaheadSummary.of("off", None, None),
                      Timings(1.0, 2.0), index, tool_calls=calls)


def test_a_choice_that_made_calls_is_a_message_of_calls_finished_as_tool_calls():
    body = openai_body(HEAD, [_done("", calls=(WEATHER, TIME)), _done("Let me look.", FinishReason.STOP, (WEATHER,), 1),
                              _done("plain", index=2), _done("", FinishReason.LENGTH, (WEATHER,), 3)], chat=True)
    calls, said, plain, cut = body["choices"]
    assert calls["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
    assert calls["finish_reason"] == said["finish_reason"] == "tool_calls" and said["message"]["content"] == "Let me look."
    assert plain["message"] == {"role": "assistant", "content": "plain"} and plain["finish_reason"] == "stop"
    assert cut["finish_reason"] == "length"  # cut short: the calls it made are kept, the reason too
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 20, "total_tokens": 23}  # as without tools


async def _items(*items):
    for item in items:
        yield item


def _chunks(items, n):
    async def read():
        return [e async for e in openai_events(_items(*items), HEAD, True, include_usage=True, n=n)]
    *events, done = [e for chunk in asyncio.run(read()) for e in sse.events(chunk.decode().splitlines())]
    assert done == sse.DONE
    return events


def test_streamed_calls_come_as_delta_tool_calls_per_choice():
    items = [Delta((1, 2), "Let me look.", 0, usage=Usage(3, 2)), Delta((3,), "", 1, usage=Usage(3, 1)),
             Delta((4, 5), "", 0, usage=Usage(3, 4), tool_calls=(WEATHER,)),
             Delta((), "", 1, usage=Usage(3, 1), tool_calls=(ToolCall("get_weather", "{}", 0, "call_c"),)),
             _done("Let me look.", calls=(WEATHER,), tokens=4), _done("", calls=(WEATHER,), index=1, tokens=1)]
    *chunks, last = _chunks(items, 2)
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks]
    assert deltas == [(0, {"role": "assistant"}, None), (1, {"role": "assistant"}, None), (0, {"content": "Let me look."}, None),
                      (0, {"tool_calls": [{"index": 0, **WEATHER.openai()}]}, None),
                      (1, {"tool_calls": [{"index": 0, "id": "call_c", "type": "function",
                                           "function": {"name": "get_weather", "arguments": "{}"}}]}, None),
                      (0, {}, "tool_calls"), (1, {}, "tool_calls")]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert last["lookahead"] == openai_body(HEAD, [_done("x")], chat=True)["lookahead"]  # as the whole body has it

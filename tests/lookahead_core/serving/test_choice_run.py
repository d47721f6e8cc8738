"""ChoiceRun: its error table (what the engine raises, as the client hears it), and a choice's calls read once."""
import pytest
from tokenizers import decoders

from lookahead_core.engine.engine import EngineOverloaded
from lookahead_core.engine.host.async_engine import EngineStopped, RequestTimeout
from lookahead_core.engine.io import EngineRequest, StepOutput
from lookahead_core.lookahead.stopping import FinishReason, StopCondition
from lookahead_core.serving import RequestError, ServeRequest
from lookahead_core.serving.choice_run import ChoiceRun
from lookahead_core.serving.text_stream import TextStream
from lookahead_core.serving.tools import ToolChoice, parse_tools
from tests.lookahead_core.helpers import char_tokenizer

TOOLS = parse_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])


def _run(timeout_s=None, own=None):
    req = ServeRequest(input_ids=(1, 2), timeout_s=own)
    ereq = EngineRequest("r", (1, 2), StopCondition(4))
    return ChoiceRun(req, ereq, None, [1, 2], 0, timeout_s, text=None, token_text=str, prompt_text=str)


@pytest.mark.parametrize("exc, status, code", [
    (EngineOverloaded("full"), 503, "overloaded"), (EngineStopped("gone"), 503, "replica_failed"),
    (ValueError("bad"), 400, None), (TypeError("bad"), 400, None), (RuntimeError("step"), 500, None)])
def test_each_engine_error_has_its_status(exc, status, code):
    with pytest.raises(RequestError) as err:
        _run().fail(exc)
    assert err.value.status == status and err.value.code == code and str(exc) in err.value.message


def test_a_deadline_is_408_for_the_clients_own_504_for_the_servers_and_ends_a_started_choice():
    for own, status in ((5.0, 408), (None, 504)):
        with pytest.raises(RequestError) as err:
            _run(timeout_s=5.0, own=own).fail(RequestTimeout())
        assert err.value.status == status and err.value.code == "timeout"
    started = _run(timeout_s=5.0)
    started.tokens.append(7)
    started.fail(RequestTimeout())
    assert started.reason is FinishReason.TIMEOUT


def _tool_run(choice: ToolChoice, stops=()):
    tok = char_tokenizer()
    tok.backend_tokenizer.decoder = decoders.Fuse()  # the text as written: no space between characters
    req = ServeRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice=choice, stop=stops)
    run = ChoiceRun(req, EngineRequest("r", (40,), StopCondition(200)), None, [40], 1, None, TextStream(tok, stops),
                    token_text=str, prompt_text=str)
    return run, tok


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


@pytest.mark.parametrize("choice, text, content, calls", [
    (ToolChoice("auto"), "Let me look." + CALL + "  ", "Let me look.", [("get_weather", '{"city":"Oslo"}')]),
    (ToolChoice("auto"), "No call.", "No call.", []),
    (ToolChoice("function", "get_weather"), '{"name": "get_weather", "arguments": {"city": "Oslo"}}', "",
     [("get_weather", '{"city":"Oslo"}')]),
    (ToolChoice("none"), "Text " + CALL, "Text " + CALL, []),  # no tools offered: text as written
])
def test_a_choice_reads_its_calls_once_for_the_streamed_and_the_whole_answer(choice, text, content, calls):
    run, tok = _tool_run(choice)
    ids = tok(text)["input_ids"]
    deltas = [d for i in range(0, len(ids), 7) for d in run.on_output(StepOutput("r", ids[i:i + 7]))]
    deltas += run.on_output(StepOutput("r", [1], FinishReason.EOS)) + run.tail()
    done = run.completion()
    assert "".join(d.text for d in deltas) == done.text == content and all(d.index == 1 for d in deltas)
    streamed = [c for d in deltas for c in d.tool_calls]
    assert streamed == list(done.tool_calls) and [(c.name, c.arguments) for c in done.tool_calls] == calls
    assert sum(len(d.token_ids) for d in deltas) == done.usage.completion_tokens == len(ids) + 1  # usage as without tools


def test_a_stop_string_ends_the_text_calls_are_read_from():
    run, tok = _tool_run(ToolChoice("auto"), stops=("</tool_call>",))
    assert [d.text for d in run.on_output(StepOutput("r", tok(CALL + "more")["input_ids"]))] == [""] and run.hit
    [tail] = run.tail()  # the block never closed: no call, its text the content
    assert tail.text == run.completion().text == CALL.removesuffix("</tool_call>") and run.completion().tool_calls == ()

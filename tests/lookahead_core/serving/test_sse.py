"""The SSE encoder and parser against each other, and the parser on what a wire carries."""
import pytest

from lookahead_core.serving import sse


def test_encoded_events_parse_back_then_done_ends_the_stream():
    wire = b"".join([sse.encode({"token_ids": [1, 2], "text": "hi"}), sse.encode({"done": True}), sse.DONE_EVENT,
                     sse.encode({"after": "done"})])
    assert list(sse.events(wire.split(b"\n"))) == [{"token_ids": [1, 2], "text": "hi"}, {"done": True}, sse.DONE]


def test_comments_and_blank_lines_are_skipped_and_str_lines_work():
    lines = [": keep-alive", "", 'data: {"a": 1}', "", "data: [DONE]"]
    assert list(sse.events(lines)) == [{"a": 1}, sse.DONE]


def test_a_stream_cut_before_done_yields_what_came():
    assert list(sse.events([b'data: {"a": 1}', b""])) == [{"a": 1}]


def test_a_broken_payload_is_an_error_not_a_skip():
    with pytest.raises(ValueError):
        list(sse.events([b"data: {not json"]))

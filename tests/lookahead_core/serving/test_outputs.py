"""Finish reasons are mapped once; a completion reports its lookahead summary and serializes plainly."""
import pytest

from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.serving import Completion, LookaheadSummary, Timings, Usage, finish_reason


def test_finish_reasons_map_once_and_abort_stays_abort():
    assert [finish_reason(r) for r in ("eos", "stop", "length", "timeout", "abort")] == ["eos", "stop", "length", "timeout", "abort"]
    assert finish_reason(None) == "abort"
    with pytest.raises(ValueError, match="unknown finish reason"):
        finish_reason("done")


def test_summary_and_dict_shape():
    summary = LookaheadSummary.of("fixed", LookaheadParams(4, 3, 3), steps=3, tokens=10)
    assert (summary.n, summary.w, summary.g, summary.compression) == (4, 3, 3, 3.333)
    assert LookaheadSummary.of("off", None, steps=0, tokens=0).compression is None
    c = Completion("hi", (5, 6), "length", Usage(3, 2), summary, Timings(1.5, 2.0))
    assert c.usage.total_tokens == 5
    assert c.to_dict() == {"text": "hi", "token_ids": [5, 6], "finish_reason": "length",
                           "usage": {"prompt_tokens": 3, "completion_tokens": 2},
                           "lookahead": {"mode": "fixed", "n": 4, "w": 3, "g": 3, "steps": 3, "compression": 3.333},
                           "timings": {"ttft_ms": 1.5, "total_ms": 2.0}}
    with pytest.raises(ValueError):
        Completion("", (), "finished", Usage(1, 0), summary, Timings(0, 0))

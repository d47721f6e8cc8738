"""Finish reasons are mapped once; a completion reports its lookahead summary and serializes plainly."""
import pytest

from lookahead_core.engine.io import SequenceStats
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.stopping import FinishReason
from lookahead_core.serving import Completion, LookaheadSummary, Timings, Usage
from lookahead_core.serving.outputs import REPLICA_TEXT_SOURCES


def test_a_request_the_engine_reported_nothing_for_claims_no_figures():
    """A request cut by its deadline has tokens but no engine count: no steps, null rates, nothing by kind."""
    for counted in (None, SequenceStats(prompt_tokens=3)):
        summary = LookaheadSummary.of("fixed", LookaheadParams(4, 3, 3), counted)
        assert (summary.n, summary.steps, summary.compression, summary.mean_width) == (4, 0, None, None)
        assert summary.steps_by_kind == {} and summary.sources == {}


def test_finish_reasons_are_one_enum_of_plain_strings():
    assert [str(r) for r in FinishReason] == ["eos", "stop", "length", "abort", "timeout"]
    assert FinishReason("eos") is FinishReason.EOS and FinishReason.STOP == "stop"
    with pytest.raises(ValueError):
        FinishReason("done")


def stats(steps_by_kind, rows, tokens, proposed=(), accepted=()):
    s = SequenceStats(prompt_tokens=3, new_tokens=tokens, steps=sum(steps_by_kind.values()), rows=rows,
                      steps_by_kind=dict(steps_by_kind))
    s.record_sources(proposed, accepted)
    return s


def test_summary_and_dict_shape():
    summary = LookaheadSummary.of("fixed", LookaheadParams(4, 3, 3), stats({"full": 2, "plain": 1}, rows=27, tokens=10))
    assert (summary.n, summary.w, summary.g, summary.steps, summary.compression, summary.mean_width) == (4, 3, 3, 3, 3.333, 9.0)
    assert summary.steps_by_kind == {"full": 2, "plain": 1} and summary.sources == {}
    by_source = LookaheadSummary.of("auto", LookaheadParams(), stats({"verify": 2}, rows=9, tokens=5,
                                                                     proposed=(3, 0, 0, 4, 0), accepted=(2, 0, 0, 1, 0)))
    assert by_source.sources == {"lookup": {"proposed": 3, "accepted": 2}, "successors": {"proposed": 4, "accepted": 1}}
    copied = LookaheadSummary.of("auto", LookaheadParams(), stats({"verify": 2}, rows=9, tokens=5,
                                                                  proposed=(0, 1, 2, 0, 3), accepted=(0, 1, 1, 0, 2)))
    assert list(copied.sources) == ["pool", "shared", "history"]  # in `Source` order, proposed ones only
    assert copied.without(REPLICA_TEXT_SOURCES).sources == {"pool": {"proposed": 1, "accepted": 1}}
    c = Completion("hi", (5, 6), FinishReason.LENGTH, Usage(3, 2), summary, Timings(1.5, 2.0))
    assert c.usage.total_tokens == 5
    assert c.to_dict() == {"text": "hi", "token_ids": [5, 6], "finish_reason": "length",
                           "usage": {"prompt_tokens": 3, "completion_tokens": 2},
                           "lookahead": {"mode": "fixed", "n": 4, "w": 3, "g": 3, "steps": 3, "compression": 3.333,
                                         "steps_by_kind": {"full": 2, "plain": 1}, "mean_width": 9.0, "sources": {}},
                           "timings": {"ttft_ms": 1.5, "total_ms": 2.0}}

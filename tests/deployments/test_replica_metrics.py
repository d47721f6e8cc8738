"""The replica's Prometheus counters in vLLM's speculative-decoding names, recorded from a request's
steps and summary through fake metric objects: no Ray is started."""
import asyncio
from types import SimpleNamespace

import pytest

from deployments import replica
from lookahead_core.lookahead.stopping import FinishReason
from lookahead_core.serving import Completion, Delta, ServeRequest
from lookahead_core.serving.outputs import LookaheadSummary, Timings, Usage


class FakeMetric:
    """Records every call as Ray's metric would take it; a counter refuses what Ray's refuses."""

    made: dict[str, "FakeMetric"] = {}

    def __init__(self, name, description="", boundaries=None, tag_keys=None):
        self.name, self.tag_keys, self.calls = name, tuple(tag_keys or ()), []
        FakeMetric.made[name] = self

    def inc(self, value=1.0, tags=None):
        if value <= 0:
            raise ValueError(f"value must be >0, got {value}")
        assert set(tags or {}) == set(self.tag_keys)  # every tag named, no other
        self.calls.append((value, dict(tags or {})))

    def observe(self, value, tags=None):
        self.calls.append((value, dict(tags or {})))

    def set(self, value, tags=None):
        self.calls.append((value, dict(tags or {})))

    def totals(self, by: str | None = None) -> dict:
        out: dict = {}
        for value, tags in self.calls:
            key = tags.get(by) if by else None
            out[key] = out.get(key, 0) + value
        return out


@pytest.fixture()
def model(monkeypatch):
    """A replica with its metrics alone: fake metrics, a fake engine queue, a processor streaming `items`."""
    FakeMetric.made = {}
    monkeypatch.setattr(replica, "metrics", SimpleNamespace(Counter=FakeMetric, Histogram=FakeMetric, Gauge=FakeMetric))
    r = object.__new__(replica.ModelReplica)
    r.args = SimpleNamespace(model=SimpleNamespace(served_name="smol"), report_replica_sources=False)
    r.async_engine = SimpleNamespace(queue_depth=lambda: (1, 0))
    r._metrics()
    return r


def completion(steps_by_kind, sources, tokens=9) -> Completion:
    summary = LookaheadSummary("auto", 5, 8, 8, sum(steps_by_kind.values()), 1.5, steps_by_kind, 6.0, sources)
    return Completion("text", tuple(range(tokens)), FinishReason.EOS, Usage(4, tokens), summary, Timings(10.0, 90.0))


def test_the_counters_carry_vllms_spec_decode_names_and_tags(model):
    spec = {name: m.tag_keys for name, m in FakeMetric.made.items() if name.startswith("vllm_")}
    assert spec == {"vllm_spec_decode_num_drafts": ("model_name", "engine"),
                    "vllm_spec_decode_num_draft_tokens": ("model_name", "engine"),
                    "vllm_spec_decode_num_accepted_tokens": ("model_name", "engine"),
                    "vllm_spec_decode_num_accepted_tokens_per_pos": ("model_name", "engine", "position")}
    assert all(":" not in name for name in FakeMetric.made)  # Ray exports no ":"; Prometheus reads ray_<name>_total


def test_a_request_counts_its_tree_steps_rows_and_accepted_rows_by_depth(model):
    """Steps of 1 (the prefill's token), 3, 1, 4 and 2 tokens: accepted rows 2 + 3 + 1 = 6, at depths
    0: 3 steps, 1: 2, 2: 1; drafts are the verify and full steps, draft tokens the rows they verified."""
    sources = {"lookup": {"proposed": 20, "accepted": 4}, "pool": {"proposed": 7, "accepted": 2},
               "history": {"proposed": 3, "accepted": 0}}  # replica-text sources count, though the client is not told
    done = completion({"plain": 2, "verify": 1, "full": 2}, sources, tokens=11)
    steps = [(7,), (1, 2, 3), (4,), (5, 6, 8, 9), (10, 11)]

    async def run(req):
        for ids in steps:
            yield Delta(ids, "x", usage=Usage(4, len(ids)))
        yield done

    model.processor = SimpleNamespace(run=lambda req, engine: run(req))
    req = ServeRequest(prompt="hi", max_new_tokens=16)

    async def collect():
        return [item async for item in model.generate(req)]

    items = asyncio.run(collect())
    assert items[-1].lookahead.sources.keys() == {"lookup", "pool"}  # the client's copy, without replica text
    m, tags = FakeMetric.made, {"model_name": "smol", "engine": "0"}
    assert m["vllm_spec_decode_num_drafts"].calls == [(3, tags)]
    assert m["vllm_spec_decode_num_draft_tokens"].calls == [(30, tags)]
    assert m["vllm_spec_decode_num_accepted_tokens"].calls == [(6, tags)]
    assert m["vllm_spec_decode_num_accepted_tokens_per_pos"].totals("position") == {"0": 3, "1": 2, "2": 1}
    assert sum(m["vllm_spec_decode_num_accepted_tokens_per_pos"].totals().values()) == 6  # the accepted rows, by depth
    assert [v for v, _ in m["lookahead_accepted_tokens_per_step"].calls] == [1, 3, 1, 4, 2]


def test_plain_decoding_counts_no_draft(model):
    model._observe(completion({"plain": 9}, {}), [])
    assert all(not m.calls for name, m in FakeMetric.made.items() if name.startswith("vllm_"))
    assert FakeMetric.made["lookahead_steps"].calls == [(9, {"kind": "plain"})]

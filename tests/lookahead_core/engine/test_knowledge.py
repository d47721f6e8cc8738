"""The engine's one `ReplicaKnowledge`: what requests teach it, and an engine that forgot it all runs as a fresh one."""
import pytest

from lookahead_core import LookaheadParams
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.generation import warm_up
from lookahead_core.engine.runner.model_runner import ModelRunner
from lookahead_core.engine.step.prices import StepCosts
from lookahead_core.models.random_models import build_random_model
from tests.lookahead_core.helpers import random_prompts, req

VOCAB = 512


class FixedCosts(StepCosts):
    """Step costs set once and never timed: a step's kind and width depend on what was learned alone."""

    def __init__(self) -> None:
        super().__init__(settle=1)
        for width in range(1, 64):
            super().observe(1, width, 10.0 + 0.4 * (width - 1))

    def observe(self, batch: int, width: int, ms: float) -> None:
        pass


@pytest.fixture(scope="module")
def model():
    return build_random_model("llama", vocab_size=VOCAB)


def _engine(model) -> Engine:
    # no stored prompt prefixes: everything a repeat gains comes from the knowledge
    return Engine(ModelRunner(model, FixedCosts()), EngineConfig(max_batch=2, max_new_tokens=32, prefix_cache_tokens=0))


def _steps(engine: Engine, rid, prompt, params=None) -> list:
    engine.add_request(req(rid, prompt, 32, params or LookaheadParams(3, 2, 2)))
    steps = []
    while engine.has_work():
        steps += [(out.kind, out.width, tuple(out.tokens)) for out in engine.step()]
    return steps


def test_an_engine_that_cleared_what_it_learned_steps_as_a_fresh_one(model):
    prompt = random_prompts(5, VOCAB, seed=3)[4]  # one that repeats a segment
    fresh = _engine(model)
    status = fresh.knowledge.status()
    first = _steps(fresh, 0, prompt)
    engine = _engine(model)
    assert _steps(engine, 0, prompt) == first
    # a repeat meets the first run's text, successors, rates and yields: it steps otherwise
    again = _steps(engine, 1, prompt)
    assert len(again) < len(first)
    assert engine.knowledge.status() != status
    engine.knowledge.clear()
    assert engine.knowledge.status() == status
    assert _steps(engine, 2, prompt) == first


def test_a_restored_engine_steps_as_it_did_at_the_snapshot(model):
    prompts = random_prompts(10, VOCAB, seed=5)
    engine = _engine(model)
    _steps(engine, 0, prompts[4])
    snap = engine.knowledge.snapshot()
    at_snapshot = _steps(engine, 1, prompts[9])
    assert _steps(engine, 2, prompts[9]) != at_snapshot  # it learned more, from the very prompt
    engine.knowledge.restore(snap)
    assert _steps(engine, 3, prompts[9]) == at_snapshot


def test_requests_hold_the_engines_tables(model):
    engine = _engine(model)
    engine.add_request(req(0, [5, 6, 7], 4, LookaheadParams(3, 2, 2)))
    drafter, know = engine._seqs[0].drafter, engine.knowledge
    assert drafter.shared is know.shared_pool and drafter.history is know.history and drafter.successors is know.successors
    assert drafter.row_rates is know.row_rates[False]


def test_a_warm_up_leaves_no_trace_of_its_text(model):
    """The replica's warm-up requests teach nothing: the learned tables and the stored prompt
    prefixes are as at start, and the next request steps as on a fresh engine."""
    prompts = random_prompts(5, VOCAB, seed=3)
    config = EngineConfig(max_batch=2, max_new_tokens=32, prefix_cache_tokens=4096)
    fresh = Engine(ModelRunner(model, FixedCosts()), config)
    status = fresh.knowledge.status()
    first = _steps(fresh, 0, prompts[4])
    engine = Engine(ModelRunner(model, FixedCosts()), config)
    warm_up(engine, prompts[4], max_new_tokens=32)  # the very prompt: anything kept would show
    assert engine.knowledge.status() == status and len(engine.runner.prefixes) == 0
    assert _steps(engine, 0, prompts[4]) == first

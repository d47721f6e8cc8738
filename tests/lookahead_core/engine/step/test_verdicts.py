"""Verdicts through the batching engine: sampled walks follow the model's distribution whatever the
step's kind or candidates, draw only the rows they reach, and a seed fixes the tokens."""
import collections

import numpy as np
import pytest
import torch

from lookahead_core import LookaheadParams, SamplingParams, generate
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.io import EngineRequest
from lookahead_core.engine.step import verdicts
from lookahead_core.engine.step.planner import StepPlanner, offer
from lookahead_core.lookahead.pacing import StepChoice, StepKind
from lookahead_core.lookahead.sampling import sample_rows
from lookahead_core.lookahead.stopping import StopCondition
from tests.lookahead_core.helpers import req, run_to_end
from tests.lookahead_core.lookahead.oracles import (
    CONFIGS,
    POOL_SEED,
    PROMPT,
    G,
    N,
    V,
    counts,
    exact_joint,
    gof,
    )


@pytest.fixture(scope="module")
def model(sampler_model):
    return sampler_model


def _engine_joint(model, samples, planner=None, params=None):
    params = params or LookaheadParams(N, 2, G, pool_from_prompt=False)
    cfg = EngineConfig(max_batch=256, max_new_tokens=3, max_seq_len=16, max_waiting=samples, max_n=N, max_w=2, max_g=G)
    engine = Engine(model, cfg)
    if planner is not None:
        engine.planner = planner
    for i in range(samples):
        engine.add_request(req(i, PROMPT, 3, params, sampling=SamplingParams(1.0, seed=i)))
        if params.g:
            engine._seqs[i].drafter.pool.add_sequence(POOL_SEED)
    out, multi, sources = {i: [] for i in range(samples)}, 0, collections.Counter()
    while engine.has_work():
        for o in engine.step():
            out[o.seq_id] += o.tokens
            multi += len(o.tokens) > 1
            if o.stats is not None:
                sources.update(o.stats.accepted_from)
    return counts(tuple(t) for t in out.values()), multi, sources


def test_engine_lookahead_sampling_follows_the_model_distribution(model, logits_table):
    """End to end through the batching engine: the same 3-token joint distribution. A plumbing
    check (a wrong logits row would move the distribution far), so fewer samples suffice."""
    samples = 8_000
    look, multi, _ = _engine_joint(model, samples)
    assert multi > samples // 10  # candidates were accepted, not only bonus tokens
    assert gof(look, exact_joint(logits_table, CONFIGS["temperature 1.0"])) > 1e-3


class VerifyOnly(StepPlanner):
    def plan(self, drafts, row_price, prices):
        return [StepChoice(StepKind.VERIFY if any(opt.kind is StepKind.VERIFY for opt in o.menu) else StepKind.PLAIN)
                for o in (offer(d, row_price) for d in drafts)]


def test_steps_without_the_window_sample_the_model_distribution(model, logits_table):
    """The same check with every step verifying the candidate tree alone (its rows right after the
    last token), the kind the planner picks when the window does not pay."""
    samples = 4_000
    look, multi, _ = _engine_joint(model, samples, VerifyOnly(1))
    assert multi > samples // 10
    assert gof(look, exact_joint(logits_table, CONFIGS["temperature 1.0"])) > 1e-3


def test_successor_trees_sample_the_model_distribution(model, logits_table):
    """Trees from the replica's top-k successor table alone (no window, pool or lookup), which
    earlier requests' steps fill: the same joint distribution."""
    samples = 4_000
    params = LookaheadParams(2, 1, 0, lookup=0, successors=12, adapt=False)
    look, multi, sources = _engine_joint(model, samples, params=params)
    assert multi > samples // 10 and set(sources) == {"successors"}
    assert gof(look, exact_joint(logits_table, CONFIGS["temperature 1.0"])) > 1e-3


def test_a_step_draws_only_the_rows_its_walk_reaches(model, monkeypatch):
    """A sampled walk draws the last token's row, then the tree row holding that token, and so
    on: a step draws as many rows as it accepts tokens (the bonus included), never the rows of
    candidates it rejected, and the tokens stay plain sampling's."""
    drawn_rows = []

    def counting(logits, params, uniforms):
        drawn_rows.append(len(uniforms))
        return sample_rows(logits, params, uniforms)

    s = SamplingParams(1.0, seed=3)
    plain = generate(model, torch.tensor([[5, 0, 1, 5]]), max_new_tokens=40, eos_token_id=[], sampling=s).tokens
    monkeypatch.setattr(verdicts, "sample_rows", counting)
    engine = Engine(model, EngineConfig(max_batch=1, max_new_tokens=48, max_n=N, max_w=2, max_g=G))
    engine.add_request(req(0, [5, 0, 1, 5], 40, LookaheadParams(N, 2, G, adapt=False), sampling=s))
    engine._seqs[0].drafter.pool.add_sequence(POOL_SEED * 3)
    tokens, stats = [], None
    while engine.has_work():
        for o in engine.step():
            tokens += o.tokens
            stats = o.stats or stats
    assert tokens == plain
    ran = stats.steps + sum(stats.proposed.values())  # each step's last-token row and its tree's
    # one row per token accepted; the last step may draw past the 40th token and cut there
    assert len(tokens) <= sum(drawn_rows) <= len(tokens) + N + G
    assert sum(drawn_rows) < ran / 2, (sum(drawn_rows), ran)  # drawing every row ran would draw `ran`
    assert sum(drawn_rows) < ran  # rejected candidates' rows were never drawn


def test_a_seed_fixes_the_tokens_whatever_the_lookahead_the_batch_or_the_candidates(model):
    """Output position p draws with u(seed, p), so the tokens of a seeded request do not depend on
    its (N, W, G), on plain or paced steps, on its batch, or on what the shared pool offers."""
    prompt = [5, 0, 1, 5]
    s = SamplingParams(0.9, top_k=6, seed=42)
    plain = generate(model, torch.tensor([prompt]), max_new_tokens=24, eos_token_id=[], sampling=s).tokens
    for params in (LookaheadParams(3, 2, 3), LookaheadParams(5, 3, 3, adapt=False), LookaheadParams(2, 1, 1)):
        assert generate(model, torch.tensor([prompt]), max_new_tokens=24, params=params, eos_token_id=[],
                        sampling=s).tokens == plain
    seeds = [42, 7, 42, 9]
    lookaheads = [LookaheadParams(3, 2, 3), "auto", "off", LookaheadParams(4, 3, 3, adapt=False)]
    batch = run_to_end(Engine(model, EngineConfig(max_batch=4, max_new_tokens=32)),
                 [EngineRequest(i, tuple(prompt), StopCondition(24), la, SamplingParams(0.9, top_k=6, seed=seed))
                  for i, (seed, la) in enumerate(zip(seeds, lookaheads))])
    assert batch[0] == batch[2] == plain and batch[1] != plain
    polluted = Engine(model, EngineConfig(max_batch=2, max_new_tokens=32))
    polluted.knowledge.shared_pool.track(3)
    polluted.knowledge.shared_pool.add_text(np.random.default_rng(0).integers(0, V, 3000).tolist())
    assert run_to_end(polluted, [req("p", prompt, 24, LookaheadParams(3, 2, 3), sampling=s)])["p"] == plain
    unseeded = [generate(model, torch.tensor([prompt]), max_new_tokens=24, eos_token_id=[],
                         sampling=SamplingParams(0.9)).tokens for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1


def test_greedy_is_temperature_zero(model):
    prompt = torch.tensor([[5, 0, 1, 5]])
    greedy = generate(model, prompt, max_new_tokens=16, params=LookaheadParams(3, 2, 3), eos_token_id=[]).tokens
    t0 = generate(
        model, prompt, max_new_tokens=16, params=LookaheadParams(3, 2, 3), eos_token_id=[], sampling=SamplingParams(0.0, seed=1)
    ).tokens
    assert greedy == t0

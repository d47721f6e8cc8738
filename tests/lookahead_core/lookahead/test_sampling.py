"""Lookahead sampling keeps the model's output distribution (statistical tests with fixed seeds)."""

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lookahead_core import SamplingParams
from lookahead_core.lookahead.ngram_pool import NGramPool
from lookahead_core.lookahead.sampling import position_uniform, sample_rows, warp_rows
from lookahead_core.lookahead.tree import CandidateTree
from tests.lookahead_core.lookahead.oracles import (
    CONFIGS,
    LOOKUP,
    POOL_SEED,
    PROMPT,
    SAMPLES,
    G,
    N,
    counts,
    exact_joint,
    gof,
    sample,
    two_sample,
    warp,
)


@pytest.fixture(scope="module")
def model(sampler_model):
    return sampler_model


def engine_rule(dist_at, tree, uniforms):
    """The engine's verification: the walk draws the last token's row at its position's uniform,
    then the tree row holding that token, and so on (tree row r is step row 1 + r, node r + 1);
    rows off the walk are never drawn."""
    drawn = [-1] * (1 + tree.size)
    at, depth = 0, 0
    while True:
        drawn[at] = sample(dist_at(at), uniforms[depth])
        child = tree.child(0 if at == 0 else at, drawn[at])
        if child is None:
            return tree.walk_greedy(drawn, 1)[1]
        at, depth = child, int(tree.depth[child - 1])


def wrong_rule(dist_at, tree, uniforms):
    """Deliberately wrong: a candidate token is accepted when its probability exceeds the uniform,
    instead of only when it is the token the uniform draws."""
    node_row, depth, out = 0, 0, []
    while True:
        p = dist_at(node_row)
        child = next((r for r in range(tree.size) if tree.depth[r] == depth + 1
                      and (node_row == 0 or tree.visible[r, node_row - 1]) and p[tree.tokens[r]] > uniforms[depth]), None)
        if child is None:
            return out + [sample(p, uniforms[depth])]
        out.append(int(tree.tokens[child]))
        node_row, depth = child + 1, depth + 1


_WARPED: dict = {}


def warped(table, params, ctx):
    key = (id(table), params, ctx)
    if key not in _WARPED:
        _WARPED[key] = warp(table[ctx], params)
    return _WARPED[key]


def simulate(table, params, seed, rule=engine_rule, lookahead=True):
    """First 3 tokens: plain sampling, or lookahead verification over a candidate tree of the
    pool's candidates and a variable-length one; output position p draws with u(seed, p)."""
    pool = NGramPool(N, G)
    pool.add_sequence(POOL_SEED)
    ctx = []
    while len(ctx) < 3:
        if not lookahead:
            ctx.append(sample(warped(table, params, tuple(ctx)), position_uniform(seed, len(ctx))))
            continue
        last = (PROMPT + ctx)[-1]
        tree = CandidateTree(16)
        tree.build(([LOOKUP[last]] if last in LOOKUP else []) + pool.lookup(last)[:G])

        def dist_at(row, ctx=tuple(ctx), tree=tree):
            prefix = tuple(int(tree.tokens[r]) for r in np.flatnonzero(tree.visible[row - 1])) if row else ()
            return warped(table, params, (ctx + prefix)[:3])

        uniforms = [position_uniform(seed, len(ctx) + d) for d in range(8)]
        ctx.extend(rule(dist_at, tree, uniforms))
    return tuple(ctx[:3])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lookahead_sampling_matches_plain_sampling(logits_table, name):
    params = CONFIGS[name]
    plain = counts(simulate(logits_table, params, seed, lookahead=False) for seed in range(SAMPLES))
    look = counts(simulate(logits_table, params, 10**6 + seed) for seed in range(SAMPLES))
    exact = exact_joint(logits_table, params)
    assert gof(plain, exact) > 1e-3
    assert gof(look, exact) > 1e-3
    assert two_sample(plain, look) > 1e-3


def test_the_test_has_power_a_wrong_verifier_fails(logits_table):
    params = CONFIGS["temperature 1.0"]
    plain = counts(simulate(logits_table, params, seed, lookahead=False) for seed in range(SAMPLES))
    wrong = counts(simulate(logits_table, params, 10**6 + seed, rule=wrong_rule) for seed in range(SAMPLES))
    assert two_sample(plain, wrong) < 1e-6
    assert gof(wrong, exact_joint(logits_table, params)) < 1e-6


def test_warp_matches_hf_warpers():
    rng = np.random.default_rng(0)
    for params in [SamplingParams(0.7, top_p=0.9), SamplingParams(1.3, top_k=5), SamplingParams(0.5, top_k=20, top_p=0.8),
                   SamplingParams(1.2, min_p=0.1), SamplingParams(0.9, top_k=30, top_p=0.95, min_p=0.05)]:
        logits = rng.normal(size=(1, 64)) * 3
        scores = torch.tensor(logits, dtype=torch.float32)
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
        if params.top_k:
            scores = TopKLogitsWarper(params.top_k)(None, scores)
        if params.top_p < 1:
            scores = TopPLogitsWarper(params.top_p)(None, scores)
        if params.min_p:
            scores = MinPLogitsWarper(params.min_p)(None, scores)
        hf = torch.softmax(scores, dim=-1)[0].double().numpy()
        assert np.allclose(warp(logits[0], params), hf, atol=1e-6)


@pytest.mark.parametrize("scale", [8.0, 0.05], ids=["nucleus in the likeliest 1024", "nucleus wider: full sort"])
def test_top_p_over_a_large_vocabulary_matches_hf(scale):
    """Beyond TOP_P_PREFIX tokens, top-p sorts only the likeliest when they hold the nucleus, and
    the whole row otherwise; both are HF's TopPLogitsWarper."""
    logits = np.random.default_rng(1).normal(size=(3, 5000)) * scale
    params = SamplingParams(1.0, top_p=0.9)
    hf = torch.softmax(TopPLogitsWarper(0.9)(None, torch.tensor(logits)), dim=-1).numpy()
    ours = warp_rows(torch.tensor(logits), params).numpy()
    assert np.allclose(ours, hf, atol=1e-9) and np.allclose(ours.sum(-1), 1.0)


def test_a_tiny_temperature_is_the_greedy_limit_not_nan():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]], dtype=torch.float64)
    for t in (1e-310, 1e-300, 1e-6):
        p = warp_rows(logits, SamplingParams(t))
        assert p.tolist() == [[0.0, 1.0, 0.0, 0.0]]
        assert sample_rows(logits, SamplingParams(t), [0.999]) == [1]


@pytest.mark.parametrize(
    "kwargs, message",
    [({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"top_k": -2}, "top_k"),
     ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"seed": -1}, "seed"), ({"top_k": 2.5}, "top_k")],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{"temperature": 1.0, **kwargs})



def test_top_p_on_a_flat_row_never_sorts_the_whole_vocabulary(monkeypatch):
    """A flat row (a high temperature) with top_p 0.99 has most of the vocabulary in its nucleus:
    its threshold is found without sorting (or topk-ing) more than 1,024 tokens of a row, and the
    distribution is still HF's."""
    def bounded(real, size):
        def checked(t, *args, **kwargs):
            assert size(t, *args, **kwargs) <= 1024, "sorted a whole row"
            return real(t, *args, **kwargs)
        return checked

    def row(t, *args, **kwargs):
        return t.shape[-1]

    def k(t, k, *args, **kwargs):
        return k

    for owner in (torch, torch.Tensor):
        monkeypatch.setattr(owner, "sort", bounded(owner.sort, row))
        monkeypatch.setattr(owner, "argsort", bounded(owner.argsort, row))
        monkeypatch.setattr(owner, "topk", bounded(owner.topk, k))
    logits = torch.tensor(np.random.default_rng(2).normal(size=(2, 49152)) * 4)
    ours = warp_rows(logits, SamplingParams(100.0, top_p=0.99))
    monkeypatch.undo()
    hf = torch.softmax(TopPLogitsWarper(0.99)(None, logits / 100.0), dim=-1)
    assert 40000 < int((ours > 0).sum(-1).min())
    assert torch.allclose(ours, hf, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", ["rounded logits", "one tie wider than 1024"])
def test_top_p_with_ties_keeps_as_many_of_each_value_as_hf(kind):
    """Ties at the threshold: as many tied tokens stay as in HF (which of them is its sort's
    arbitrary order; here the lowest ids), so the sorted distributions agree."""
    rng = np.random.default_rng(3)
    if kind == "rounded logits":
        logits = np.round(rng.normal(size=(3, 5000)) * 4) / 2
    else:
        logits = np.zeros((2, 5000))
        logits[:, rng.permutation(5000)[:1000]] = 2.0
    for top_p in (0.5, 0.9, 0.99):
        hf = torch.softmax(TopPLogitsWarper(top_p)(None, torch.tensor(logits)), dim=-1)
        ours = warp_rows(torch.tensor(logits), SamplingParams(1.0, top_p=top_p))
        assert torch.equal((ours > 0).sum(-1), (hf > 0).sum(-1))
        assert torch.allclose(ours.sort(-1).values, hf.sort(-1).values, atol=1e-12, rtol=0)

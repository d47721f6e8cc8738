"""Lookahead sampling keeps the model's output distribution (statistical tests with fixed seeds)."""
import collections
import itertools

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from lookahead_core import LookaheadParams, SamplingParams, generate
from lookahead_core.engine import verification
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.planner import StepPlanner, offer
from lookahead_core.engine.request import EngineRequest
from lookahead_core.engine.step_costs import StepCosts
from lookahead_core.lookahead.ngram_pool import NGramPool
from lookahead_core.lookahead.pacing import StepChoice, StepKind
from lookahead_core.lookahead.sampling import position_uniform, sample_rows, warp_rows
from lookahead_core.lookahead.stopping import StopCondition
from lookahead_core.lookahead.tree import CandidateTree
from lookahead_core.models.random_models import build_random_model
from tests.lookahead_core.helpers import req, run_to_end
from tests.lookahead_core.lookahead.oracles import sample, warp

V = 8
PROMPT = [5]
POOL_SEED = [5, 0, 1, 5, 0, 2, 5, 3, 4, 5, 6, 7, 0, 1, 4]  # several continuations per key, shared first tokens
N, G = 3, 3
# Prompt-lookup-like candidates of other lengths, merged into the tree with the pool's: (5, 0, 1, 4)
# shares its first row with the pool's (0, 2) after 5.
LOOKUP = {5: (0, 1, 4), 0: (1,), 3: (4, 5, 0, 1)}
SAMPLES = 20_000
CONFIGS = {
    "temperature 1.0": SamplingParams(1.0),
    "temperature 0.7, top-p 0.9": SamplingParams(0.7, top_p=0.9),
    "top-k 5": SamplingParams(1.0, top_k=5),
}


@pytest.fixture(scope="module")
def model():
    return build_random_model("llama", vocab_size=V, hidden=32, layers=2, heads=4, kv_heads=2, init_std=0.12, seed=3)


@pytest.fixture(scope="module")
def logits_table(model):
    """Next-token logits after PROMPT + every context of up to 3 tokens (one batched forward)."""
    table = {}
    for depth in range(4):
        ctxs = list(itertools.product(range(V), repeat=depth))
        ids = torch.tensor([PROMPT + list(c) for c in ctxs])
        with torch.no_grad():
            out = model(ids).logits[:, -1].double().numpy()
        table.update({c: out[i] for i, c in enumerate(ctxs)})
    return table


def exact_joint(table, params):
    joint = np.zeros((V, V, V))
    p1 = warp(table[()], params)
    for a in range(V):
        p2 = warp(table[(a,)], params)
        for b in range(V):
            joint[a, b] = p1[a] * p2[b] * warp(table[(a, b)], params)
    return joint


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


def counts(samples):
    c = np.zeros((V, V, V))
    for s in samples:
        c[s] += 1
    return c


def chi2_pvalue(stat, dof):
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def gof(obs, probs, min_expected=5.0):
    """Goodness of fit to exact probabilities; cells expected below 5 are pooled into one."""
    exp = probs.ravel() * obs.sum()
    obs = obs.ravel()
    small = exp < min_expected
    o = np.append(obs[~small], obs[small].sum())
    e = np.append(exp[~small], exp[small].sum())
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    return chi2_pvalue(stat, int(keep.sum()) - 1)


def two_sample(a, b, min_count=10):
    """Chi-square test of homogeneity of two count tables (sparse cells pooled)."""
    a, b = a.ravel(), b.ravel()
    small = (a + b) < min_count
    a = np.append(a[~small], a[small].sum())
    b = np.append(b[~small], b[small].sum())
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    n_a, n_b = a.sum(), b.sum()
    tot = a + b
    ea, eb = tot * n_a / (n_a + n_b), tot * n_b / (n_a + n_b)
    stat = float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum())
    return chi2_pvalue(stat, len(a) - 1)


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
    def plan(self, drafts, row_price, waiting=0):
        return [StepChoice(StepKind.VERIFY if any(opt.kind is StepKind.VERIFY for opt in o.menu) else StepKind.PLAIN)
                for o in (offer(d, row_price) for d in drafts)]


def test_steps_without_the_window_sample_the_model_distribution(model, logits_table):
    """The same check with every step verifying the candidate tree alone (its rows right after the
    last token), the kind the planner picks when the window does not pay."""
    samples = 4_000
    look, multi, _ = _engine_joint(model, samples, VerifyOnly(StepCosts(), 1))
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
    monkeypatch.setattr(verification, "sample_rows", counting)
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


def test_warp_matches_hf_warpers():
    rng = np.random.default_rng(0)
    for params in [SamplingParams(0.7, top_p=0.9), SamplingParams(1.3, top_k=5), SamplingParams(0.5, top_k=20, top_p=0.8)]:
        logits = rng.normal(size=(1, 64)) * 3
        scores = torch.tensor(logits, dtype=torch.float32)
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
        if params.top_k:
            scores = TopKLogitsWarper(params.top_k)(None, scores)
        if params.top_p < 1:
            scores = TopPLogitsWarper(params.top_p)(None, scores)
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


@pytest.mark.parametrize(
    "kwargs, message",
    [({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"top_k": -2}, "top_k"),
     ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"seed": -1}, "seed"), ({"top_k": 2.5}, "top_k")],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{"temperature": 1.0, **kwargs})

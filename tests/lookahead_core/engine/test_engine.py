"""Every request through the batching engine equals its own single-sequence greedy output."""
import pytest

from lookahead_core import LookaheadParams
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine, EngineOverloaded
from lookahead_core.engine.model_runner import ModelRunner
from lookahead_core.engine.step_costs import StepCosts
from lookahead_core.models.random_models import build_random_model
from tests.lookahead_core.helpers import well_conditioned_cases

VOCAB = 512
MAX_NEW = 28


def seed_oracle(engine, seq_id, oracle):
    """Seed a request's pool with its true continuation (plus decoys): long accepted blocks."""
    seq = engine._seqs[seq_id]
    n = seq.params.n
    seq.pool.add_sequence(oracle)
    for i in range(len(oracle) - n + 1):
        cont = tuple(oracle[i + 1 : i + n])
        seq.pool.add(oracle[i], cont[:-1] + ((cont[-1] + 1) % VOCAB,))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def setup(request):
    model = build_random_model(request.param)
    cases = well_conditioned_cases(model, 10, VOCAB, seed=21, max_new_tokens=MAX_NEW + 8)
    return model, [(p, ref[:MAX_NEW], p + ref) for p, ref in cases]


def _first_unique_index(ref, at_least):
    return next(k for k in range(at_least, len(ref)) if ref[k] not in ref[:k])


def test_mixed_batch_matches_single_sequence_greedy(setup):
    model, cases = setup
    engine = Engine(model, EngineConfig(max_batch=4, prefill_chunk=8, max_new_tokens=64))
    P = LookaheadParams
    params = [None, P(3, 4, 4), P(5, 7, 7), P(2, 1, 1), P(7, 15, 15), P(4, 5, 5), None, P(3, 2, 2), P(5, 3, 6), P(6, 4, 4)]
    arrivals = {0: [0, 1, 2], 2: [3, 4], 5: [5], 9: [6, 7], 14: [8, 9]}
    eos = {3: cases[3][1][_first_unique_index(cases[3][1], 5)], 7: cases[7][1][_first_unique_index(cases[7][1], 12)]}
    oracle = {1, 4, 8, 9}
    changes = {6: [(2, None)], 8: [(0, P(4, 5, 5))], 10: [(5, P(3, 4, 4)), (1, P(5, 2, 3))], 30: [(8, None)]}
    abort_at = {12: 6}

    outputs = {i: [] for i in range(len(cases))}
    reasons, widest, multi = {}, 0, 0
    step = 0
    while step == 0 or engine.has_work() or any(s > step for s in arrivals):
        for i in arrivals.get(step, []):
            engine.add_request(i, cases[i][0], max_new_tokens=MAX_NEW, params=params[i], eos_token_id=[eos[i]] if i in eos else [])
            if i in oracle:
                seed_oracle(engine, i, cases[i][2])
        for i, p in changes.get(step, []):
            engine.set_params(i, p)
        if step in abort_at:
            assert engine.abort(abort_at[step])
        widest = max(widest, engine.queue_depth()[0])
        for out in engine.step():
            outputs[out.seq_id] += out.tokens
            multi += len(out.tokens) > 1
            if out.finish_reason:
                reasons[out.seq_id] = out.finish_reason
        step += 1
        assert step < 500

    for i, (_, ref, _) in enumerate(cases):
        if i == 6:
            assert reasons[i] == "abort" and outputs[i] == ref[: len(outputs[i])]
        elif i in eos:
            k = ref.index(eos[i])
            assert outputs[i] == ref[: k + 1] and reasons[i] == "eos", i
        else:
            assert outputs[i] == ref and reasons[i] == "length", i
    assert widest == 4 and multi >= 10
    assert engine.queue_depth() == (0, 0) and not engine._seqs
    assert all(length == 0 for length in engine.cache.lengths)


def test_one_token_prompts_and_one_new_token(setup):
    model, cases = setup
    engine = Engine(model, EngineConfig(max_batch=3, prefill_chunk=4, max_new_tokens=8))
    engine.add_request("a", [7], max_new_tokens=1, params=LookaheadParams(3, 2, 2), eos_token_id=[])
    engine.add_request("b", cases[0][0], max_new_tokens=1, eos_token_id=[])
    got = {}
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.seq_id, []).extend(out.tokens)
    from tests.lookahead_core.helpers import NO_EOS, hf_greedy

    assert got["a"] == hf_greedy(model, [7], 1, **NO_EOS)
    assert got["b"] == cases[0][1][:1]


def test_queue_depth_and_slot_limit(setup):
    model, cases = setup
    engine = Engine(model, EngineConfig(max_batch=2, prefill_chunk=64, max_new_tokens=64))
    for i in range(5):
        engine.add_request(i, cases[i][0], max_new_tokens=MAX_NEW, eos_token_id=[])
    assert engine.queue_depth() == (0, 5)
    for _ in range(4):
        engine.step()
    running, waiting = engine.queue_depth()
    assert running == 2 and waiting == 3
    while engine.has_work():
        engine.step()
        assert engine.queue_depth()[0] <= 2


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"prompt": []}, ValueError, "at least one token"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"max_new_tokens": 65}, ValueError, "exceeds this engine's limit of 64"),
        ({"prompt": [5] * 100, "max_new_tokens": 64}, ValueError, "exceeds this engine's limit of 128 tokens"),
        ({"prompt": [5, 9999]}, ValueError, "outside the model's vocabulary"),
        ({"params": LookaheadParams(9, 2, 2)}, ValueError, "n=9 exceeds"),
        ({"params": LookaheadParams(3, 17, 2)}, ValueError, "w=17 exceeds"),
        ({"params": (3, 2, 2)}, TypeError, "LookaheadParams"),
    ],
)
def test_request_validation(setup, kwargs, error, message):
    model, _ = setup
    engine = Engine(model, EngineConfig(max_batch=2, max_seq_len=128, max_new_tokens=64))
    args = {"prompt": [5, 6], "max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=message):
        engine.add_request("x", args.pop("prompt"), **args)
    assert engine.queue_depth() == (0, 0)


def test_duplicate_ids_and_overload(setup):
    model, _ = setup
    engine = Engine(model, EngineConfig(max_batch=1, max_waiting=2, max_new_tokens=8))
    engine.add_request("a", [5], max_new_tokens=4)
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("a", [5], max_new_tokens=4)
    # One free slot plus two waiting places: a burst of three is taken in before any step.
    engine.add_request("b", [5], max_new_tokens=4)
    engine.add_request("c", [5], max_new_tokens=4)
    with pytest.raises(EngineOverloaded, match="3 requests are already waiting"):
        engine.add_request("d", [5], max_new_tokens=4)
    engine.step()  # "a" takes the slot; "b" and "c" fill the two waiting places
    assert engine.queue_depth() == (1, 2)
    with pytest.raises(EngineOverloaded, match="2 requests are already waiting"):
        engine.add_request("d", [5], max_new_tokens=4)


def test_engine_limits_against_the_model(setup):
    model, _ = setup
    with pytest.raises(ValueError, match="context length"):
        Engine(model, EngineConfig(max_seq_len=5000))


def test_abort_waiting_and_prefilling(setup):
    model, cases = setup
    engine = Engine(model, EngineConfig(max_batch=1, prefill_chunk=4, max_new_tokens=64))
    long_prompt = max((c[0] for c in cases), key=len)
    engine.add_request("p", long_prompt, max_new_tokens=8, eos_token_id=[])
    engine.add_request("w", [5, 6], max_new_tokens=8, eos_token_id=[])
    engine.step()  # "p" is mid-prefill
    assert engine.abort("p") and engine.abort("w")
    assert not engine.abort("w") and not engine.abort("nope")
    outs = engine.step()
    assert {o.seq_id: o.finish_reason for o in outs} == {"p": "abort", "w": "abort"}
    assert not engine.has_work()
    engine.add_request("q", cases[0][0], max_new_tokens=MAX_NEW, eos_token_id=[])
    toks = []
    while engine.has_work():
        toks += [t for o in engine.step() for t in o.tokens]
    assert toks == cases[0][1]


@pytest.mark.parametrize("cap", [8, 0])
def test_shared_pool_speeds_up_a_repeat_and_keeps_it_exact(setup, cap):
    """A finished request's text becomes candidates for the next; a repeat of it is then decoded
    in long accepted blocks, and stays token-identical. cap 0 turns the shared pool off."""
    model, cases = setup
    engine = Engine(model, EngineConfig(max_batch=2, max_new_tokens=64, shared_pool_cap=cap))
    prompt, ref, _ = cases[0]
    steps = []
    for i in range(2):
        engine.add_request(i, prompt, max_new_tokens=MAX_NEW, params=LookaheadParams(4, 2, 3, pool_from_prompt=False), eos_token_id=[])
        tokens = []
        while engine.has_work():
            for out in engine.step():
                tokens += out.tokens
                if out.finish_reason:
                    steps.append(out.stats["steps"])
        assert tokens == ref
    if cap:
        assert steps[1] <= steps[0] / 2 and len(engine.shared_pool) > 0
    else:
        assert steps[1] == steps[0] and engine.shared_pool is None


def test_only_the_tail_of_a_finished_request_joins_the_shared_pool(setup):
    model, cases = setup
    engine = Engine(model, EngineConfig(max_batch=2, max_new_tokens=64, shared_pool_text=6))
    prompt, ref, _ = cases[0]
    engine.add_request(0, prompt, max_new_tokens=MAX_NEW, params=LookaheadParams(3, 2, 2), eos_token_id=[])
    while engine.has_work():
        engine.step()
    assert 1 <= len(engine.shared_pool) <= 6 - 3 + 1  # the 4 trigrams of the last 6 tokens at most
    tail = (prompt + ref)[-6:]
    cands: list = []
    engine.shared_pool.fill(3, tail[-3], cands, 4)
    assert tuple(tail[-2:]) in cands


@pytest.mark.parametrize("wide_cost", [3.0, 1.01])
def test_a_batch_steps_as_wide_as_pays_and_stays_exact(setup, wide_cost):
    """Four requests with oracle pools under a measured cost curve held still (alpha ~0): where any
    wide step costs 3 one-token steps, no row can pay for the whole batch and every step is one
    token wide; where width is nearly free, rows run whole steps and accept long blocks."""
    model, cases = setup
    costs = StepCosts(alpha=1e-9)
    for batch in (1, 2, 4):
        costs.observe(batch, 1, 10.0)
        costs.observe(batch, 2, 10.0 * wide_cost)
    engine = Engine(ModelRunner(model, costs), EngineConfig(max_batch=4, max_new_tokens=64))
    for i in range(4):
        engine.add_request(i, cases[i][0], max_new_tokens=MAX_NEW, params=LookaheadParams(4, 3, 3), eos_token_id=[])
        seed_oracle(engine, i, cases[i][2])
    outputs, widths = {i: [] for i in range(4)}, []
    while engine.has_work():
        running = engine.queue_depth()[0]
        before = costs.observed
        for out in engine.step():
            outputs[out.seq_id] += out.tokens
        if costs.observed > before and running == 4:
            widths.append(costs.last[1])
    assert all(outputs[i] == cases[i][1] for i in range(4))
    assert widths, "no step ran with all four requests"
    if wide_cost > 2:
        assert set(widths) == {1}
    else:
        assert max(widths) > 1 and sum(w > 1 for w in widths) >= len(widths) // 2

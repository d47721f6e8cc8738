"""Every request through the batching engine equals its own single-sequence greedy output."""
import pytest

from lookahead_core import LookaheadParams
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine, EngineOverloaded
from lookahead_core.engine.io import EngineRequest
from lookahead_core.engine.runner.model_runner import ModelRunner
from lookahead_core.engine.step.prices import StepCosts
from lookahead_core.lookahead.pacing import StepKind
from lookahead_core.lookahead.sampling import SamplingParams
from lookahead_core.lookahead.stopping import FinishReason, StopCondition
from lookahead_core.models.random_models import build_random_model
from tests.lookahead_core.helpers import req, well_conditioned_cases

VOCAB = 512
MAX_NEW = 28


class HeldCosts(StepCosts):
    """Step costs set once and then held: later forwards are counted, never timed."""

    def __init__(self, cells: dict[tuple[int, int], float]) -> None:
        super().__init__(settle=1)
        for (batch, width), ms in cells.items():
            super().observe(batch, width, ms)
        self.held = True

    def observe(self, batch: int, width: int, ms: float) -> None:
        if not getattr(self, "held", False):
            super().observe(batch, width, ms)
            return
        self.observed += 1
        self.last = (batch, width, ms)


def seed_oracle(engine, seq_id, oracle):
    """Seed a request's pool with its true continuation (plus decoys): long accepted blocks."""
    seq = engine._seqs[seq_id]
    n = seq.drafter.params.n
    seq.drafter.pool.add_sequence(oracle)
    for i in range(len(oracle) - n + 1):
        cont = tuple(oracle[i + 1 : i + n])
        seq.drafter.pool.add(oracle[i], cont[:-1] + ((cont[-1] + 1) % VOCAB,))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def setup(request):
    model = build_random_model(request.param)
    cases = well_conditioned_cases(model, 10, VOCAB, seed=21, max_new_tokens=MAX_NEW + 8)
    return model, [(p, ref[:MAX_NEW], p + ref) for p, ref in cases]


def _first_unique_index(ref, at_least):
    return next(k for k in range(at_least, len(ref)) if ref[k] not in ref[:k])


def test_mixed_batch_matches_single_sequence_greedy(setup):
    model, cases = setup
    # width held free: on a tiny model measured step costs are timing noise, and they set how wide
    # paced rows run and which tree rows a step keeps
    free = HeldCosts({(batch, width): 10.0 for batch in (1, 2, 4) for width in range(1, 80)})
    engine = Engine(ModelRunner(model, free), EngineConfig(max_batch=4, prefill_chunk=8, max_new_tokens=64))
    P = LookaheadParams
    params = [None, P(3, 4, 4), P(5, 7, 7), P(2, 1, 1), P(7, 15, 15), P(4, 5, 5), None, P(3, 2, 2), P(5, 3, 6), P(6, 4, 4)]
    arrivals = {0: [0, 1, 2], 2: [3, 4], 5: [5], 9: [6, 7], 14: [8, 9]}
    eos = {3: cases[3][1][_first_unique_index(cases[3][1], 5)], 7: cases[7][1][_first_unique_index(cases[7][1], 12)]}
    oracle = {1, 4, 8, 9}
    abort_at = {12: 6}

    outputs = {i: [] for i in range(len(cases))}
    reasons, widest, multi = {}, 0, 0
    step = 0
    while step == 0 or engine.has_work() or any(s > step for s in arrivals):
        for i in arrivals.get(step, []):
            engine.add_request(req(i, cases[i][0], MAX_NEW, params[i], [eos[i]] if i in eos else []))
            if i in oracle:
                seed_oracle(engine, i, cases[i][2])
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
    assert all(length == 0 for length in engine.runner.cache.lengths)


def test_one_token_prompts_and_one_new_token(setup):
    model, cases = setup
    engine = Engine(model, EngineConfig(max_batch=3, prefill_chunk=4, max_new_tokens=8))
    engine.add_request(req("a", [7], 1, LookaheadParams(3, 2, 2)))
    engine.add_request(req("b", cases[0][0], 1))
    got = {}
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.seq_id, []).extend(out.tokens)
    from tests.lookahead_core.helpers import NO_EOS, hf_greedy

    assert got["a"] == hf_greedy(model, [7], 1, **NO_EOS)
    assert got["b"] == cases[0][1][:1]


def test_prompts_arriving_together_share_a_steps_prefill_budget(setup):
    """prefill_chunk tokens a step in all: three short prompts get their first tokens in one step;
    a prompt past the budget's rest continues next step, and the tokens are the greedy ones."""
    model, cases = setup
    engine = Engine(model, EngineConfig(max_batch=4, prefill_chunk=12, max_new_tokens=8, prefix_cache_tokens=0))
    prompts = [[5, 9, 17], [40, 41, 42, 7], [100, 3, 77], [8, 6, 4, 2, 9, 11]]
    for i, prompt in enumerate(prompts):
        engine.add_request(req(i, prompt, 4))
    out: dict = {i: [] for i in range(4)}
    for o in engine.step():
        out[o.seq_id] += o.tokens
    assert [i for i in out if out[i]] == [0, 1, 2] and engine.queue_depth() == (3, 1)  # 3 + 4 + 3 tokens, then 2 of the 6
    assert engine.scheduler.prefilled == 2
    for o in engine.step():  # the fourth prompt's last 4 tokens, and a decode step for the first three
        out[o.seq_id] += o.tokens
    assert all(out.values()) and engine.queue_depth() == (4, 0)
    while engine.has_work():
        for o in engine.step():
            out[o.seq_id] += o.tokens
    from tests.lookahead_core.helpers import NO_EOS, hf_greedy

    assert out == {i: hf_greedy(model, prompt, 4, **NO_EOS) for i, prompt in enumerate(prompts)}


def test_queue_depth_and_slot_limit(setup):
    model, cases = setup
    engine = Engine(model, EngineConfig(max_batch=2, prefill_chunk=64, max_new_tokens=64))
    for i in range(5):
        engine.add_request(req(i, cases[i][0], MAX_NEW))
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
        ({"prompt": "ab"}, ValueError, "sequence of token ids"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"max_new_tokens": 65}, ValueError, "exceeds this engine's limit of 64"),
        ({"prompt": [5] * 100, "max_new_tokens": 64}, ValueError, "exceeds this engine's limit of 128 tokens"),
        ({"prompt": [5, 9999]}, ValueError, "outside the model's vocabulary"),
        ({"params": LookaheadParams(9, 2, 2)}, ValueError, "n=9 exceeds"),
        ({"params": LookaheadParams(3, 17, 2)}, ValueError, "w=17 exceeds"),
        ({"params": (3, 2, 2)}, ValueError, "LookaheadParams"),
        ({"logprobs": 21}, ValueError, "logprobs"),
    ],
)
def test_request_validation(setup, kwargs, error, message):
    model, _ = setup
    engine = Engine(model, EngineConfig(max_batch=2, max_seq_len=128, max_new_tokens=64))
    args = {"prompt": [5, 6], "max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=message):
        engine.add_request(req("x", args.pop("prompt"), args.pop("max_new_tokens"), **args))
    assert engine.queue_depth() == (0, 0)


def test_add_request_takes_an_engine_request_only(setup):
    model, _ = setup
    engine = Engine(model, EngineConfig(max_batch=1, max_new_tokens=8))
    with pytest.raises(TypeError, match="EngineRequest"):
        engine.add_request({"prompt": [5]})


def test_duplicate_ids_and_overload(setup):
    model, _ = setup
    engine = Engine(model, EngineConfig(max_batch=1, max_waiting=2, max_new_tokens=8))
    engine.add_request(req("a", [5], 4))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request(req("a", [5], 4))
    # One free slot plus two waiting places: a burst of three is taken in before any step.
    engine.add_request(req("b", [5], 4))
    engine.add_request(req("c", [5], 4))
    with pytest.raises(EngineOverloaded, match="3 requests are already waiting"):
        engine.add_request(req("d", [5], 4))
    engine.step()  # "a" takes the slot; "b" and "c" fill the two waiting places
    assert engine.queue_depth() == (1, 2)
    with pytest.raises(EngineOverloaded, match="2 requests are already waiting"):
        engine.add_request(req("d", [5], 4))


def test_engine_limits_against_the_model(setup):
    model, _ = setup
    with pytest.raises(ValueError, match="context length"):
        Engine(model, EngineConfig(max_seq_len=5000))


def test_abort_waiting_and_prefilling(setup):
    model, cases = setup
    engine = Engine(model, EngineConfig(max_batch=1, prefill_chunk=4, max_new_tokens=64))
    long_prompt = max((c[0] for c in cases), key=len)
    engine.add_request(req("p", long_prompt, 8))
    engine.add_request(req("w", [5, 6], 8))
    engine.step()  # "p" is mid-prefill
    assert engine.abort("p") and engine.abort("w")
    assert not engine.abort("w") and not engine.abort("nope")
    outs = engine.step()
    assert {o.seq_id: o.finish_reason for o in outs} == {"p": "abort", "w": "abort"}
    assert not engine.has_work()
    engine.add_request(req("q", cases[0][0], MAX_NEW))
    toks = []
    while engine.has_work():
        toks += [t for o in engine.step() for t in o.tokens]
    assert toks == cases[0][1]


def _run_alone(engine, rid, prompt, params, max_new_tokens=MAX_NEW):
    """One request through `engine` on its own: its tokens and final stats."""
    engine.add_request(req(rid, prompt, max_new_tokens, params))
    tokens, stats = [], None
    while engine.has_work():
        for out in engine.step():
            tokens += out.tokens
            stats = out.stats if out.finish_reason else stats
    return tokens, stats


@pytest.mark.parametrize("cap", [8, 0])
def test_shared_pool_speeds_up_a_repeat_and_keeps_it_exact(setup, cap):
    """A finished request's text becomes candidates for the next; a repeat of it is then decoded
    in long accepted blocks, and stays token-identical. cap 0 turns the shared pool off."""
    model, cases = setup
    # no stored prompt prefixes: the repeat must differ from the first run by the shared pool alone
    # every proposed row runs (row price 0): with the measured row price, rows trimmed by the rates
    # the first run taught and by the host's load made the repeat 27 or 28 steps with the pool off
    engine = Engine(model, EngineConfig(max_batch=2, max_new_tokens=64, shared_pool_cap=cap, history_tokens=0,
                                        prefix_cache_tokens=0, row_price=0.0))
    prompt, ref, _ = cases[0]
    params = LookaheadParams(4, 2, 3, pool_from_prompt=False, successors=0, adapt=False)
    runs = [_run_alone(engine, i, prompt, params) for i in range(2)]
    assert [tokens for tokens, _ in runs] == [ref, ref]
    steps = [stats.steps for _, stats in runs]
    if cap:
        assert steps[1] <= steps[0] / 2 and len(engine.knowledge.shared_pool) > 0
    else:
        assert steps[1] == steps[0] and engine.knowledge.shared_pool is None


@pytest.mark.parametrize(("topk", "prefill"), [(8, False), (8, True), (0, False)])
def test_successor_table_speeds_up_a_repeat_and_keeps_it_exact(setup, topk, prefill):
    """The top-k the model gave after each token in one request's steps become the next request's
    candidate tree; a repeat then accepts more per step and stays token-identical. topk 0 turns
    the table off; `successor_prefill` also records every prompt token's."""
    model, cases = setup
    # every proposed row runs (row price 0): the measured price depends on the host's load, this test on the table only
    engine = Engine(model, EngineConfig(max_batch=2, max_new_tokens=64, shared_pool_cap=0, successor_topk=topk,
                                        history_tokens=0, successor_prefill=prefill, row_price=0.0))
    long = next(p for p, _, _ in cases if len(set(p)) > 8)
    _run_alone(engine, -1, long, "off", max_new_tokens=1)  # a prefill, then one plain step of the last token
    if topk:
        assert engine.knowledge.successors is not None
        assert (engine.knowledge.successors.table[long] >= 0).all() == prefill
        engine.knowledge.successors.clear()
    prompt, ref, _ = cases[0]
    prompt, ref, _ = cases[0]
    runs = [_run_alone(engine, i, prompt, LookaheadParams(2, 1, 0, lookup=0, successors=16, adapt=False))
            for i in range(2)]
    assert [tokens for tokens, _ in runs] == [ref, ref]
    first, second = (stats for _, stats in runs)
    if topk:
        assert second.steps < first.steps and second.accepted_from["successors"] > 0
        assert engine.knowledge.successors is not None and engine.knowledge.successors.known > len(set(prompt))
    else:
        assert second.steps == first.steps == len(ref) and engine.knowledge.successors is None
        assert second.proposed == {}


@pytest.mark.parametrize("history", [4096, 0])
def test_history_of_finished_text_speeds_up_a_repeat_and_keeps_it_exact(setup, history):
    """A request whose own text has no prompt-lookup match copies from the replica's history of
    finished requests instead; history_tokens 0 turns it off."""
    model, cases = setup
    # every proposed row runs (row price 0): with the measured price a loaded host trimmed the copied
    # rows, and the repeat took 15 steps to the first run's 28
    engine = Engine(model, EngineConfig(max_batch=2, max_new_tokens=64, shared_pool_cap=0, successor_topk=0,
                                        history_tokens=history, row_price=0.0))
    prompt, ref, _ = cases[0]
    runs = [_run_alone(engine, i, prompt, LookaheadParams(2, 1, 0, successors=0, adapt=False)) for i in range(2)]
    assert [tokens for tokens, _ in runs] == [ref, ref]
    first, second = (stats for _, stats in runs)
    assert "history" not in first.accepted_from
    if history:
        assert second.steps <= first.steps / 2 and second.accepted_from["history"] > 0
        assert engine.knowledge.status()["text"]["tokens"] == 2 * (len(prompt) + len(ref)) + 2
    else:
        assert second.steps == first.steps and engine.knowledge.history is None


def test_full_steps_teach_the_replica_what_a_new_request_expects_of_them(setup):
    """A paced greedy request alone runs whole steps; what they yielded becomes where the next
    greedy request's pacer starts, and sampled requests' figure is left alone."""
    model, cases = setup
    engine = Engine(model, EngineConfig(max_batch=2, max_new_tokens=64, shared_pool_cap=0))
    prompt, ref, _ = cases[0]
    tokens, stats = _run_alone(engine, 0, prompt, LookaheadParams(2, 1, 0))
    assert tokens == ref and stats.steps_by_kind.get("full", 0) > 0
    means = engine.knowledge.full_yields.means
    assert any(means[(False, copied)] != 2.0 for copied in (False, True))
    assert means[(True, False)] == means[(True, True)] == 2.0
    engine.add_request(req(1, prompt, MAX_NEW, LookaheadParams(2, 1, 0)))
    assert engine._seqs[1].drafter.pacer.yields == engine.knowledge.full_yields.start(False)
    # what greedy rows accepted is not what a sampled request expects of its rows, nor the reverse
    engine.add_request(req(2, prompt, MAX_NEW, LookaheadParams(2, 1, 0), sampling=SamplingParams(1.0, seed=0)))
    greedy, sampled = engine._seqs[1], engine._seqs[2]
    assert greedy.drafter.row_rates is engine.knowledge.row_rates[False] and sampled.drafter.row_rates is engine.knowledge.row_rates[True]
    assert engine.knowledge.row_rates[False] is not engine.knowledge.row_rates[True]
    assert set(engine.knowledge.status()["full_step_yield"]) == {"greedy", "greedy_copied", "sampled", "sampled_copied"}


def test_successor_nodes_that_do_not_earn_their_row_are_left_out(setup):
    """The planner prices one more row from measured step costs; tree rows accepted less often
    than that price leave a whole step, and the output stays exact."""
    model, cases = setup
    engine = Engine(model, EngineConfig(max_batch=2, max_new_tokens=64, shared_pool_cap=0))
    prompt, ref, _ = cases[0]
    params = LookaheadParams(2, 1, 0, lookup=0, successors=16, adapt=False)
    proposed = []
    for i, price in enumerate([0.0, 0.0, 0.05]):  # the first run fills the table
        engine.planner.pinned_price = price
        tokens, stats = _run_alone(engine, i, prompt, params)
        assert tokens == ref
        proposed.append(stats.proposed.get("successors", 0) / stats.steps)
    rates = engine.knowledge.successors.rates()[:16]
    assert (rates < 0.05).any() and 0 < proposed[2] < proposed[1]


def test_where_only_a_second_row_is_cheap_steps_verify_the_likeliest_row(setup):
    """Measured costs held: two rows cost 1.05 one-token steps, more cost 2. A paced request
    whose successor table knows its text then verifies its one likeliest tree row most steps (width
    2), accepts it often, and stays exact."""
    model, cases = setup
    costs = HeldCosts({(1, 1): 10.0, (1, 2): 10.5} | {(1, width): 20.0 for width in range(3, 64)})
    engine = Engine(ModelRunner(model, costs), EngineConfig(max_batch=2, max_new_tokens=64, shared_pool_cap=0,
                                                            history_tokens=0))
    prompt, ref, _ = cases[0]
    params = LookaheadParams(3, 2, 2, lookup=0)
    # a plain run teaches the table the text's own successors (a paced one also records rejected rows')
    assert _run_alone(engine, 0, prompt, "off")[0] == ref
    engine.add_request(req(1, prompt, MAX_NEW, params))
    tokens, steps, stats = [], [], None
    while engine.has_work():
        for out in engine.step():
            tokens += out.tokens
            steps.append((out.kind, out.width))
            stats = out.stats or stats
    assert tokens == ref
    verify = [width for kind, width in steps if kind is StepKind.VERIFY]
    assert set(verify) == {2} and len(verify) >= 0.7 * len(steps)  # the rest: the window's retries
    assert stats.steps < 0.8 * len(ref) and stats.accepted_from["successors"] > 0


def test_only_the_tail_of_a_finished_request_joins_the_shared_pool(setup):
    model, cases = setup
    engine = Engine(model, EngineConfig(max_batch=2, max_new_tokens=64, shared_pool_text=6))
    prompt, ref, _ = cases[0]
    engine.add_request(req(0, prompt, MAX_NEW, LookaheadParams(3, 2, 2)))
    while engine.has_work():
        engine.step()
    assert 1 <= len(engine.knowledge.shared_pool) <= 6 - 3 + 1  # the 4 trigrams of the last 6 tokens at most
    tail = (prompt + ref)[-6:]
    cands: list = []
    engine.knowledge.shared_pool.fill(3, tail[-3], cands, 4)
    assert tuple(tail[-2:]) in cands


@pytest.mark.parametrize("wide_cost", [3.0, 1.01])
def test_a_batch_steps_as_wide_as_pays_and_stays_exact(setup, wide_cost):
    """Four requests with oracle pools under a measured cost curve held still: where any
    wide step costs 3 one-token steps, no row can pay for the whole batch and every step is one
    token wide; where width is nearly free, rows run whole steps and accept long blocks."""
    model, cases = setup
    # every width held, so the machine's real timings cannot move them
    costs = HeldCosts({(batch, width): 10.0 * (1 if width == 1 else wide_cost)
                       for batch in (1, 2, 4) for width in range(1, 64)})
    engine = Engine(ModelRunner(model, costs), EngineConfig(max_batch=4, max_new_tokens=64))
    for i in range(4):
        engine.add_request(req(i, cases[i][0], MAX_NEW, LookaheadParams(4, 3, 3)))
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


def test_a_row_that_does_not_pace_lets_paced_rows_ride_its_width(setup):
    """A request with adapt off runs every step whole; the paced rows beside it take that width
    for free, even before a one-token step of their batch size was ever measured."""
    model, cases = setup
    engine = Engine(ModelRunner(model, StepCosts()), EngineConfig(max_batch=4, max_new_tokens=64))
    engine.add_request(req("fixed", cases[0][0], MAX_NEW, LookaheadParams(5, 4, 4, adapt=False)))
    for i in range(1, 4):
        engine.add_request(req(i, cases[i][0], MAX_NEW, LookaheadParams(3, 2, 2)))
        seed_oracle(engine, i, cases[i][2])
    kinds, outputs = [], {i: [] for i in range(1, 4)}
    while engine.has_work():
        full_batch = engine.queue_depth()[0] == 4
        for out in engine.step():
            if out.seq_id != "fixed":
                outputs[out.seq_id] += out.tokens
                if full_batch and out.kind is not None:
                    kinds.append(out.kind)
    assert all(outputs[i] == cases[i][1] for i in range(1, 4))
    assert kinds and sum(k is not StepKind.PLAIN for k in kinds) >= 0.8 * len(kinds), kinds


def test_a_fixed_request_cannot_widen_other_rows_past_the_slo(setup):
    """A fixed (N, W, G) runs whole while the step fits `slo_tpot_ms` for every row; beside plain requests, where
    its width would break the SLO, it is priced like a paced row and nobody's step widens for it.
    Every request's tokens stay exact either way."""
    model, cases = setup
    fixed = LookaheadParams(5, 8, 8, adapt=False)
    # a step costs 10 ms a token of width: the fixed request's 33+ rows would cost 300+ ms
    cells = {(batch, width): 10.0 * width for batch in (1, 2, 4) for width in range(1, 80)}

    def run(slo, requests):
        engine = Engine(ModelRunner(model, HeldCosts(cells)), EngineConfig(max_batch=4, max_new_tokens=64,
                                                                           slo_tpot_ms=slo))
        for i, params in requests:
            engine.add_request(req(i, cases[i][0], MAX_NEW, params))
        outputs, widths = {i: [] for i, _ in requests}, []
        while engine.has_work():
            running = engine.queue_depth()[0]
            for out in engine.step():
                outputs[out.seq_id] += out.tokens
                if running == len(requests) and out.kind is not None:
                    widths.append(out.width)
        assert all(outputs[i] == cases[i][1] for i, _ in requests)
        return widths

    batch = [(0, fixed), (1, None), (2, None), (3, None)]
    assert max(run(None, batch)) >= 33  # no SLO: the fixed request sets everyone's width
    assert set(run(12.0, batch)) == {1}  # 33 rows at 10 ms each never fit 12 ms a token
    # 330 ms for its 33 rows: the fixed row's own tokens would bring the batch's mean under 300 ms
    # a token, but each plain row yields one token of that step
    assert set(run(300.0, batch)) == {1}
    assert min(run(None, [(0, fixed)])) >= 33  # alone, without an SLO: every step whole


def test_a_caller_finish_keeps_the_text_up_to_the_stop_and_is_no_abort(setup):
    """`Engine.finish`: a running request ends as STOP at the tokens the caller kept; that text,
    not what the engine decoded past it, becomes history, and it does not count as aborted."""
    model, cases = setup
    engine = Engine(model, EngineConfig(max_batch=2, max_new_tokens=64, shared_pool_cap=0))
    prompt = list(cases[0][0])
    engine.add_request(req("s", prompt, MAX_NEW))
    produced = []
    while len(produced) < 5:
        for out in engine.step():
            produced += out.tokens
    written = engine.knowledge.history.written
    assert engine.finish("s", FinishReason.STOP, kept=3)
    assert not engine.finish("s", FinishReason.STOP, kept=3)  # already ended
    outs = [o for _ in range(2) for o in engine.step()]
    assert [(o.seq_id, o.finish_reason) for o in outs] == [("s", FinishReason.STOP)]
    assert engine.queue_depth() == (0, 0) and engine.aborted == 0
    history = engine.knowledge.history
    assert history.ring[written : history.written].tolist() == [*prompt, *produced[:3], -1]


def test_kv_slots_come_from_the_memory_budget(setup):
    model, _ = setup
    runner = ModelRunner(model)
    one = Engine(runner, EngineConfig(max_batch=1, max_seq_len=256)).kv_plan
    per_slot, prefixes = one.bytes_per_slot, one.reserved_bytes
    assert prefixes == 512 * one.bytes_per_token  # the stored prompt prefixes' budget, prefix_cache_tokens
    engine = Engine(runner, EngineConfig(max_batch=16, max_seq_len=256, kv_cache_memory=3 * per_slot + prefixes + 1))
    assert engine.max_batch == 3 and engine.kv_plan.slots == 3 and engine.scheduler.max_batch == 3
    assert "3 slots" in engine.kv_plan.describe() and "of prompt prefixes" in engine.kv_plan.describe()
    tight = 3 * per_slot + prefixes - 1  # the prefixes come out of the budget first
    assert Engine(runner, EngineConfig(max_batch=16, max_seq_len=256, kv_cache_memory=tight)).max_batch == 2
    assert Engine(runner, EngineConfig(max_batch=16, max_seq_len=256, kv_cache_memory=tight,
                                       prefix_cache_tokens=0)).max_batch == 3
    assert Engine(runner, EngineConfig(max_batch=2, max_seq_len=256, kv_cache_memory=0.5),
                  free_bytes=100 * per_slot).max_batch == 2
    with pytest.raises(ValueError, match="holds no sequence.*max_seq_len"):
        Engine(runner, EngineConfig(max_seq_len=256, kv_cache_memory=per_slot // 2))


def test_step_layouts_kept_are_bounded(setup):
    model, _ = setup
    runner = ModelRunner(model, max_layouts=4)
    for n in range(2, 8):
        runner.layout(LookaheadParams(n, 2, 2))
    assert len(runner._layouts) == 4


def test_an_engine_at_max_n_3_runs_auto_requests_and_one_below_is_refused_at_start(setup):
    model, cases = setup
    with pytest.raises(ValueError, match=r"engine.lookahead .* n=3 exceeds this engine's limit of 2"):
        EngineConfig(max_n=2)
    engine = Engine(model, EngineConfig(max_batch=4, max_n=3, max_new_tokens=64))
    for i in range(8):
        engine.add_request(EngineRequest(i, tuple(cases[i][0]), StopCondition(MAX_NEW), "auto"))
    outputs, reasons = {i: [] for i in range(8)}, {}
    while engine.has_work():
        for out in engine.step():
            outputs[out.seq_id] += out.tokens
            if out.finish_reason:
                reasons[out.seq_id] = out.finish_reason
    assert all(reasons[i] == "length" and outputs[i] == cases[i][1] for i in range(8))
    with pytest.raises(ValueError, match="n=4 exceeds"):
        engine.add_request(req("big", [5], 4, LookaheadParams(4, 2, 2)))


def _drain(engine) -> dict:
    out: dict = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.seq_id, []).extend(o.tokens)
    return out


@pytest.mark.parametrize("lookahead", ["off", LookaheadParams(3, 2, 2)])
def test_the_choices_of_one_request_share_its_prefill_and_decode_as_alone(setup, lookahead):
    """Four choices of one request (two greedy copies, two seeded draws) beside another request: the
    prompt is prefilled once and copied, each choice decodes what it decodes alone, and the request
    holds at most `request_slots` slots, the other request admitted before its later choices."""
    model, cases = setup
    prompt, ref = cases[0][2][:12], cases[0][2][12 : 12 + MAX_NEW]  # a greedy continuation with clear margins
    sampled = [SamplingParams(temperature=0.9, seed=7), SamplingParams(temperature=0.9, seed=8)]
    choices = [None, None, *sampled]

    def request(i, sampling, group=None):
        return req(f"c{i}", prompt, MAX_NEW, lookahead if lookahead != "off" else None, sampling=sampling, group=group)

    alone = {}
    for i, sampling in enumerate(choices):
        engine = Engine(model, EngineConfig(max_batch=4, max_seq_len=128, max_new_tokens=64))
        engine.add_request(request(i, sampling))
        alone[f"c{i}"] = _drain(engine)[f"c{i}"]
    assert alone["c0"][: len(ref)] == ref

    engine = Engine(model, EngineConfig(max_batch=4, max_seq_len=128, max_new_tokens=64, request_slots=3,
                                        prefix_cache_tokens=0))
    for i, sampling in enumerate(choices):
        engine.add_request(request(i, sampling, group="g"))
    engine.add_request(req("other", cases[1][0], MAX_NEW))
    prefilled = []
    original = engine.runner.prefill_jobs

    def spy(jobs, every):
        prefilled.extend((job.seq.seq_id, job.tokens, job.sibling) for job in jobs)
        return original(jobs, every)

    engine.runner.prefill_jobs = spy
    out = _drain(engine)
    assert {k: out[k] for k in alone} == alone and out["other"] == cases[1][1]
    assert [sid for sid, _, _ in prefilled].index("other") < [sid for sid, _, _ in prefilled].index("c1")
    assert prefilled[:4] == [("c0", len(prompt), None), ("other", len(cases[1][0]), None), ("c1", 1, 0), ("c2", 1, 0)]
    # c3 waits for a slot (the request holds 3); it copies a choice still running, or prefills where all have ended
    (c3, tokens, sibling), = prefilled[4:]
    assert c3 == "c3" and (tokens, sibling is None) in ((1, False), (len(prompt), True))

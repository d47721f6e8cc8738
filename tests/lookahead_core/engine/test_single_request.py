"""One request through a one-slot engine (what `generate` runs), its pool seeded from the true
continuation: long accepted blocks on every step, exact, and nothing reallocated."""
import itertools
from types import SimpleNamespace

import pytest

from lookahead_core import LookaheadParams
from lookahead_core.engine.generation import single_request_engine
from lookahead_core.engine.step.planner import StepPlanner, offer
from lookahead_core.lookahead.pacing import StepChoice, StepKind
from lookahead_core.models.random_models import build_random_model
from tests.lookahead_core.helpers import hf_greedy, req, well_conditioned_cases

VOCAB = 512
MAX_NEW = 32


def _decode(model, prompt, params, max_new, eos=(), oracle=None, planner=None, row_price=None):
    engine = single_request_engine(model, len(prompt), max_new, params)
    if planner is not None:
        engine.planner = planner
    engine.planner.pinned_price = row_price
    engine.add_request(req(0, prompt, max_new, params, eos))
    seq = engine._seqs[0]
    if oracle is not None:
        n = params.n
        # True n-grams first, then a decoy per key that differs in its last token: the true
        # continuation is never the first candidate and always the longest match.
        seq.drafter.pool.add_sequence(oracle)
        for i in range(len(oracle) - n + 1):
            cont = tuple(oracle[i + 1 : i + n])
            seq.drafter.pool.add(oracle[i], cont[:-1] + ((cont[-1] + 1) % VOCAB,))
    blocks, kinds = [], []
    while engine.has_work():
        outs = [out for out in engine.step() if out.tokens]
        blocks += [out.tokens for out in outs]
        kinds += [out.kind for out in outs]
    dec = SimpleNamespace(new_tokens=seq.new_tokens, steps=seq.stats.steps, finish_reason=seq.finish_reason,
                          accepted_histogram=seq.stats.accepted_histogram, kinds=kinds)
    return dec, blocks


@pytest.fixture(scope="module", params=["llama", "gpt2", "gemma"])
def model_and_cases(request):
    model = build_random_model(request.param)
    # References run past MAX_NEW so the seeded pool holds n-grams up to the last step.
    cases = well_conditioned_cases(model, 4, VOCAB, seed=5, max_new_tokens=MAX_NEW + 8)
    return model, [(prompt, ref[:MAX_NEW], prompt + ref) for prompt, ref in cases]


@pytest.mark.parametrize("n,w,g", [(2, 1, 2), (3, 2, 4), (5, 3, 6), (7, 4, 6)])
def test_oracle_pool_accepts_long_blocks_and_stays_exact(model_and_cases, n, w, g):
    model, cases = model_and_cases
    for prompt, ref, oracle in cases:
        # every step whole with every row: the pool alone decides the blocks, not the host's timings
        dec, blocks = _decode(model, prompt, LookaheadParams(n, w, g, successors=0, adapt=False), MAX_NEW,
                              oracle=oracle, row_price=0.0)
        assert dec.new_tokens == ref
        assert max(len(b) for b in blocks) == n
        # Nearly every step takes a full block; the pool's own harvests may evict a few.
        assert len(ref) / dec.steps >= 0.6 * n, dec.accepted_histogram


def test_every_step_kind_stays_exact(model_and_cases):
    """Steps that leave out the window, or everything but the last token, in any order: the
    pacer's choices move only speed. Its own judgement follows timings, so here it cycles."""
    kinds = itertools.cycle([StepKind.FULL, StepKind.VERIFY, StepKind.PLAIN, StepKind.VERIFY, StepKind.VERIFY, StepKind.FULL])

    class Cycling(StepPlanner):
        def plan(self, drafts, row_price, prices):
            offers = [offer(d, row_price) for d in drafts]
            wanted = [next(kinds) for _ in offers]
            wanted = [k if any(opt.kind is k for opt in o.menu) else StepKind.PLAIN for k, o in zip(wanted, offers)]
            return [StepChoice(k, rows=o.full_rows if k is StepKind.FULL else None) for k, o in zip(wanted, offers)]

    model, cases = model_and_cases
    seen = set()
    for n, w, g in [(3, 2, 2), (5, 3, 6)]:
        for prompt, ref, oracle in cases:
            dec, blocks = _decode(model, prompt, LookaheadParams(n, w, g), MAX_NEW, oracle=oracle,
                                  planner=Cycling(1))
            assert dec.new_tokens == ref
            assert any(k is StepKind.VERIFY and len(b) > 1 for k, b in zip(dec.kinds, blocks)), "steps without the window accepted nothing"
            assert all(len(b) == 1 for k, b in zip(dec.kinds, blocks) if k is StepKind.PLAIN)
            seen |= set(dec.kinds)
    assert seen == {StepKind.FULL, StepKind.VERIFY, StepKind.PLAIN}


# every step whole with every row: a rerun steps as the first run did, whatever the host's timings
WHOLE = LookaheadParams(5, 3, 6, adapt=False)


def test_eos_inside_an_accepted_block(model_and_cases):
    model, cases = model_and_cases
    params = WHOLE
    checked = 0
    for prompt, ref, oracle in cases:
        _, blocks = _decode(model, prompt, params, MAX_NEW, oracle=oracle, row_price=0.0)
        offset = 0
        for block in blocks:
            if len(block) >= 3 and block[1] not in ref[: offset + 1]:
                eos = block[1]
                dec, cut_blocks = _decode(model, prompt, params, MAX_NEW, eos=[eos], oracle=oracle, row_price=0.0)
                assert dec.new_tokens == ref[: offset + 2]
                assert dec.new_tokens == hf_greedy(model, prompt, MAX_NEW, eos_token_id=eos)
                assert dec.finish_reason == "eos" and cut_blocks[-1] == block[:2]
                checked += 1
                break
            offset += len(block)
    assert checked >= 2


def test_length_limit_inside_an_accepted_block(model_and_cases):
    model, cases = model_and_cases
    prompt, ref, oracle = cases[0]
    params = WHOLE
    _, blocks = _decode(model, prompt, params, MAX_NEW, oracle=oracle, row_price=0.0)
    first_long = next(i for i, b in enumerate(blocks) if len(b) >= 3)
    limit = sum(len(b) for b in blocks[:first_long]) + 2
    dec, cut_blocks = _decode(model, prompt, params, limit, oracle=oracle, row_price=0.0)
    assert dec.new_tokens == ref[:limit] and dec.finish_reason == "length"
    assert len(cut_blocks[-1]) == 2


def test_cache_never_grows_beyond_its_allocation(model_and_cases):
    model, cases = model_and_cases
    prompt, ref, _ = cases[1]
    params = LookaheadParams(4, 3, 3)
    engine = single_request_engine(model, len(prompt), MAX_NEW, params)
    engine.add_request(req(0, prompt, MAX_NEW, params))
    seq = engine._seqs[0]
    engine.step()  # prefill and the first decode step allocate the KV lazily
    ptrs = [layer.keys.data_ptr() for layer in engine.runner.cache.layers]
    mask_ptr = engine.runner.buffers.mask.data_ptr()
    while engine.has_work():
        engine.step()
        if not seq.finished:
            assert engine.runner.cache.lengths[0] == len(seq.tokens) - 1
    assert ptrs == [layer.keys.data_ptr() for layer in engine.runner.cache.layers]
    assert mask_ptr == engine.runner.buffers.mask.data_ptr()
    assert seq.new_tokens == ref


def test_step_after_finish_does_nothing(model_and_cases):
    model, cases = model_and_cases
    engine = single_request_engine(model, len(cases[0][0]), 2, None)
    engine.add_request(req(0, cases[0][0], 2))
    while engine.has_work():
        engine.step()
    assert engine.step() == [] and not engine.has_work()

"""Logprobs from the step's own rows equal a full forward's log-softmax, with lookahead or without."""
import pytest
import torch

from lookahead_core import LookaheadParams
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.io import token_logprobs
from lookahead_core.models.random_models import build_random_model
from tests.lookahead_core.helpers import req, well_conditioned_cases

VOCAB = 256
MAX_NEW = 20


@pytest.fixture(scope="module")
def setup():
    model = build_random_model("llama", vocab_size=VOCAB)
    return model, well_conditioned_cases(model, 4, VOCAB, seed=5, max_new_tokens=MAX_NEW)


def _run(model, prompt, params, oracle=None):
    engine = Engine(model, EngineConfig(max_batch=2, prefill_chunk=5, max_new_tokens=MAX_NEW))
    engine.add_request(req("r", prompt, MAX_NEW, params, logprobs=3, prompt_logprobs=2))
    if oracle is not None:  # the true continuation in the pool: long accepted blocks
        engine._seqs["r"].drafter.pool.add_sequence(oracle)
    tokens, lps, prompt_lps, multi = [], [], None, 0
    while engine.has_work():
        for out in engine.step():
            tokens += out.tokens
            lps += out.logprobs
            multi += len(out.tokens) > 1
            if out.prompt_logprobs is not None:
                assert prompt_lps is None
                prompt_lps = out.prompt_logprobs
    return tokens, lps, prompt_lps, multi


@pytest.mark.parametrize("params", [None, LookaheadParams(3, 2, 2), LookaheadParams(4, 3, 3, lookup=6)])
def test_logprobs_equal_a_full_forward(setup, params):
    model, cases = setup
    multi = 0
    for prompt, ref in cases:
        tokens, lps, prompt_lps, m = _run(model, prompt, params, oracle=prompt + ref if params else None)
        multi += m
        assert tokens == ref
        with torch.no_grad():
            full = torch.log_softmax(model(torch.tensor([prompt + ref])).logits[0].float(), -1)
        expect = [full[len(prompt) - 1 + i, t].item() for i, t in enumerate(ref)]
        assert [lp.token for lp in lps] == ref
        assert [lp.logprob for lp in lps] == pytest.approx(expect, abs=1e-4)
        for i, lp in enumerate(lps):
            top = full[len(prompt) - 1 + i].topk(3)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert lp.top[0][0] == lp.token  # greedy
        assert len(prompt_lps) == len(prompt) and prompt_lps[0] is None
        assert [lp.token for lp in prompt_lps[1:]] == prompt[1:]
        assert [lp.logprob for lp in prompt_lps[1:]] == pytest.approx(
            [full[i - 1, prompt[i]].item() for i in range(1, len(prompt))], abs=1e-4)
        assert all(len(lp.top) == 2 for lp in prompt_lps[1:])
    if params is not None:
        assert multi > 0  # accepted candidates' rows were read, not only row 0


def test_token_logprobs_without_alternatives():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    out = token_logprobs(logits, [1, 0], [0, 2], 0)
    assert [o.token for o in out] == [0, 2] and all(o.top == () for o in out)
    assert out[0].logprob == pytest.approx(torch.log_softmax(logits[1], -1)[0].item())


def test_out_of_range_alternatives_are_refused(setup):
    model, _ = setup
    engine = Engine(model, EngineConfig(max_batch=1))
    with pytest.raises(ValueError, match="logprobs must be an integer in"):
        engine.add_request(req("r", [1, 2], 2, logprobs=21))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request(req("r", [1, 2], 2, prompt_logprobs=-1))

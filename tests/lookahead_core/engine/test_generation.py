"""Lookahead output equals Hugging Face greedy `generate`, token for token, on every architecture."""
import pytest
import torch

from lookahead_core import LookaheadParams, generate, stream
from lookahead_core.models.random_models import ARCHITECTURES, build_random_model
from tests.lookahead_core.helpers import (
    NO_EOS,
    hf_greedy,
    longest_cycle_free_ratio,
    random_prompts,
    well_conditioned_cases,
)

CONFIGS = [(2, 1, 1), (3, 4, 4), (5, 7, 7), (7, 15, 15)]
PROMPTS = 20
MAX_NEW = 24
VOCAB = 512


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request):
    return request.param


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_lookahead_equals_hf_greedy(arch, attn):
    model = build_random_model(arch, attn_implementation=attn, vocab_size=VOCAB)
    cases = well_conditioned_cases(model, PROMPTS, VOCAB, 10 * ARCHITECTURES.index(arch) + (attn == "eager"), MAX_NEW)
    assert min(len(prompt) for prompt, _ in cases) == 1
    distinct, multi_token_steps = [], 0
    for prompt, ref in cases:
        assert len(ref) == MAX_NEW
        distinct.append(longest_cycle_free_ratio(ref))
        plain = generate(model, torch.tensor([prompt]), max_new_tokens=MAX_NEW, eos_token_id=[])
        assert plain.tokens == ref
        assert plain.stats.steps == MAX_NEW and plain.stats.compression == 1.0
        for n, w, g in CONFIGS:
            res = generate(model, torch.tensor([prompt]), max_new_tokens=MAX_NEW, params=LookaheadParams(n, w, g), eos_token_id=[])
            assert res.tokens == ref, f"{arch}/{attn} N,W,G={n},{w},{g} prompt len {len(prompt)}"
            assert res.stats.new_tokens == MAX_NEW
            assert sum(k * v for k, v in res.stats.accepted_histogram.items()) == MAX_NEW
            assert max(res.stats.accepted_histogram) <= max(n, LookaheadParams().lookup + 1)
            multi_token_steps += sum(v for k, v in res.stats.accepted_histogram.items() if k > 1)
    # The random model must not loop, or n-gram hits would be cheap and hide bugs.
    assert sum(distinct) / len(distinct) > 0.6, distinct
    # Verification and cache compaction must have been exercised.
    assert multi_token_steps > 0


@pytest.mark.parametrize("n,w,g", CONFIGS)
def test_max_new_tokens_one(arch, n, w, g):
    model = build_random_model(arch)
    for prompt in random_prompts(3, VOCAB, seed=7):
        ref = hf_greedy(model, prompt, 1, **NO_EOS)
        res = generate(model, torch.tensor([prompt]), max_new_tokens=1, params=LookaheadParams(n, w, g), eos_token_id=[])
        assert res.tokens == ref and res.finish_reason == "length" and res.stats.steps == 1


def test_default_eos_is_the_models_own():
    model = build_random_model("llama")
    prompt = random_prompts(1, VOCAB, seed=3)[0]
    long_ref = hf_greedy(model, prompt, 40, **NO_EOS)
    eos = long_ref[10]
    assert eos not in long_ref[:10]
    model.generation_config.eos_token_id = eos
    ref = hf_greedy(model, prompt, 40)
    res = generate(model, torch.tensor([prompt]), max_new_tokens=40, params=LookaheadParams(3, 4, 4))
    assert res.tokens == ref and res.tokens[-1] == eos and res.finish_reason == "eos"


def test_stream_yields_the_accepted_blocks():
    model = build_random_model("qwen2")
    prompt = random_prompts(5, VOCAB, seed=11)[4]
    ref = hf_greedy(model, prompt, 30, **NO_EOS)
    blocks = list(stream(model, torch.tensor([prompt]), max_new_tokens=30, params=LookaheadParams(4, 5, 5), eos_token_id=[]))
    assert [t for b in blocks for t in b] == ref
    assert all(1 <= len(b) <= 4 for b in blocks)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, ValueError, r"shape \[1, T\]"),
        ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, ValueError, "at least one token"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"max_new_tokens": 5000}, ValueError, "context length"),
        ({"input_ids": torch.tensor([[5, 512]])}, ValueError, "outside the model's vocabulary"),
        ({"input_ids": torch.tensor([[-1, 5]])}, ValueError, "outside the model's vocabulary"),
        ({"params": (3, 4, 4)}, ValueError, "LookaheadParams"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    model = build_random_model("llama")
    args = {"input_ids": torch.tensor([[5, 6]]), "max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=message):
        generate(model, args.pop("input_ids"), **args)

"""Stored prompt prefixes: a prompt that starts with one copies its keys and values and prefills
only the rest, and its output is the one a full prefill gives (float32)."""
import numpy as np
import pytest
import torch

from lookahead_core import LookaheadParams
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.runner.kv_cache import BatchKVCache
from lookahead_core.engine.runner.prefix_cache import PrefixCache
from lookahead_core.models.random_models import build_random_model
from tests.lookahead_core.helpers import NO_EOS, hf_greedy, min_top2_margin, req

VOCAB = 512
MAX_NEW = 16


@pytest.fixture(scope="module")
def model():
    return build_random_model("llama")


def _run(engine, rid, prompt, params=None):
    engine.add_request(req(rid, prompt, MAX_NEW, params))
    tokens = []
    while engine.has_work():
        for out in engine.step():
            tokens += out.tokens
    return tokens


def _prompts(count, shared, seed):
    """Prompts that start with the same `shared` tokens (a system prompt) and then differ."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(2, VOCAB, (shared,), generator=gen).tolist()
    return [system + torch.randint(2, VOCAB, (6 + 3 * i,), generator=gen).tolist() for i in range(count)]


def test_prompts_sharing_a_system_prompt_reuse_it_and_decode_as_a_full_prefill_does(model):
    prompts = [p for p in _prompts(8, 24, seed=3)
               if min_top2_margin(model, p, hf_greedy(model, p, MAX_NEW, **NO_EOS)) > 1e-4][:4]
    assert len(prompts) == 4
    refs = [hf_greedy(model, p, MAX_NEW, **NO_EOS) for p in prompts]
    engine = Engine(model, EngineConfig(max_batch=2, prefill_chunk=8, max_new_tokens=64, prefix_cache_tokens=256))
    for i, (prompt, ref) in enumerate(zip(prompts, refs)):
        for mode in (None, LookaheadParams(3, 2, 2)):
            assert _run(engine, f"{i}-{mode}", prompt, mode) == ref
    status = engine.runner.prefixes.status()
    # the first prompt was stored when it came again; every later one reused at least the 24 shared tokens
    assert status["hits"] == 2 * len(prompts) - 2
    assert status["reused_tokens"] >= 24 * status["hits"]
    assert 0 < status["token_hit_rate"] < 1 and status["tokens"] <= 256


def test_a_repeated_prompt_reuses_all_of_it_but_its_last_token(model):
    """Seen once, a prompt is not copied; seen twice, it is, and the third time reuses it."""
    prompt = _prompts(1, 30, seed=5)[0]
    engine = Engine(model, EngineConfig(max_batch=1, prefill_chunk=8, max_new_tokens=64, prefix_cache_tokens=128))
    first = _run(engine, "a", prompt)
    assert len(engine.runner.prefixes) == 0
    assert _run(engine, "a2", prompt) == first and len(engine.runner.prefixes) == 1
    chunks = []  # the prefill forwards' lengths
    prefill = engine.runner.prefill
    engine.runner.prefill = lambda ids, *args, **kw: chunks.append(ids.shape[1]) or prefill(ids, *args, **kw)
    assert _run(engine, "b", prompt) == first == hf_greedy(model, prompt, MAX_NEW, **NO_EOS)
    assert engine.runner.prefixes.status()["reused_tokens"] == len(prompt) - 1
    assert chunks == [1]  # the repeat prefilled its last token alone, for its first new token


def test_off_and_prompt_logprobs_prefill_in_full(model):
    prompt = _prompts(1, 20, seed=7)[0]
    off = Engine(model, EngineConfig(max_batch=1, max_new_tokens=64, prefix_cache_tokens=0))
    assert off.runner.prefixes is None and _run(off, "a", prompt) == _run(off, "b", prompt)
    engine = Engine(model, EngineConfig(max_batch=1, max_new_tokens=64, prefix_cache_tokens=128))
    _run(engine, "a", prompt)
    _run(engine, "a2", prompt)  # seen twice: stored
    assert len(engine.runner.prefixes) == 1
    engine.add_request(req("echo", prompt, 2, prompt_logprobs=1))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert len(outs[0].prompt_logprobs) == len(prompt)  # computed, not copied
    assert engine.runner.prefixes.status()["hits"] == 0


def _kv_cache():
    cache = BatchKVCache(num_layers=2, max_batch=1, capacity=64)
    for layer in cache.slot_layers:
        layer.lazy_initialization(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    return cache


def test_a_prompt_seen_once_is_not_copied_seen_twice_it_is():
    cache = _kv_cache()
    store = PrefixCache(capacity_tokens=40, min_match=4)
    prompt = list(range(10, 27))  # 17 tokens: not a multiple of min_match
    cache.slot_layers[0].keys[0, :, :17] = torch.arange(17.0)[:, None]
    store.store(prompt, cache, 0)
    assert len(store) == 0 and store.tokens == 0 and store.load(prompt, cache, 0) == 0
    store.store(prompt, cache, 0)
    assert len(store) == 1 and store.tokens == 17
    cache.slot_layers[0].keys.zero_()
    assert store.load(prompt + [1], cache, 0) == 17
    assert torch.equal(cache.slot_layers[0].keys[0, 0, :17, 0], torch.arange(17.0))
    assert store.load(prompt[:16] + [1], cache, 0) == 16  # one token differs: the prefix before it
    store.clear()
    store.store(prompt, cache, 0)  # cleared: seen for the first time again
    assert len(store) == 0


def test_a_later_turn_replaces_the_entry_it_contains():
    """Turn 2 starts with turn 1's prompt and turn 3 with turn 2's: each stores the part seen
    before (at a multiple of min_match), and the longer entry replaces the one inside it, which
    it serves as well."""
    cache = _kv_cache()
    store = PrefixCache(capacity_tokens=64, min_match=4)
    turn1 = list(range(100, 122))  # 22 tokens
    turn2 = turn1 + list(range(300, 310))  # 32
    turn3 = turn2 + list(range(400, 408))  # 40
    other = list(range(500, 512))
    for prompt in (other, other, turn1, turn2):
        store.store(prompt, cache, 0)
    assert store.tokens == 12 + 20 and np.array_equal(store._entries[max(store._entries)].tokens, turn1[:20])
    store.store(turn3, cache, 0)
    assert len(store) == 2 and store.tokens == 12 + 32  # turn1[:20] went: turn3[:32] holds it
    assert np.array_equal(store._entries[max(store._entries)].tokens, turn2)
    assert store.load(turn1 + [1], cache, 0) == 22 and store.load(other + [1], cache, 0) == 12
    store.store(turn1, cache, 0)  # inside an entry already: nothing new
    assert len(store) == 2 and store.tokens == 44


def test_entries_stay_within_their_token_budget_least_recently_used_out():
    cache = _kv_cache()
    store = PrefixCache(capacity_tokens=40, min_match=4)
    a, b, c = list(range(10, 30)), list(range(100, 120)), list(range(200, 220))
    for prompt in (a, a, b, b):  # each stored the second time it is seen
        cache.slot_layers[0].keys[0, :, :20] = float(prompt[0])
        store.store(prompt, cache, 0)
    assert len(store) == 2 and store.tokens == 40
    store.store(a[:12], cache, 0)  # held already, inside `a`: nothing new, `a` becomes the most recent
    assert len(store) == 2
    store.store(c, cache, 0)
    assert len(store) == 2 and store.tokens == 40  # first sight: not copied
    store.store(c, cache, 0)  # room for it: `b`, the least recently used, goes
    assert store.tokens == 40 and store.load(b + [1], cache, 0) == 0
    cache.slot_layers[0].keys.zero_()
    assert store.load(a[:15] + [9, 9], cache, 0) == 15
    assert float(cache.slot_layers[0].keys[0, 0, 14, 0]) == 10.0 and float(cache.slot_layers[0].keys[0, 0, 15, 0]) == 0.0
    assert store.load(a[:3] + [1] * 10, cache, 0) == 0  # under min_match
    s = store.status()
    assert (s["lookups"], s["hits"], s["reused_tokens"]) == (3, 1, 15)
    assert s["token_hit_rate"] == round(15 / (21 + 17 + 13), 4)
    assert np.array_equal(store._entries[max(store._entries)].tokens, c)

"""Config values that validate must start: what only the loaded model or the KV plan can check is
checked once, at Engine init, with one message naming the field."""
import re
from pathlib import Path

import pytest
import yaml

from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.runner.memory_plan import plan_kv
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.models.random_models import build_random_model
from tests.lookahead_core.helpers import req

README = Path(__file__).resolve().parents[3] / "README.md"
LLAMA2_7B_FP16_KV_PER_TOKEN = 32 * 2 * 32 * 128 * 2  # layers x (K, V) x KV heads x head_dim x bytes


@pytest.fixture(scope="module")
def model():
    return build_random_model("llama", vocab_size=32)


def test_cuda_graph_shapes_set_for_a_cpu_engine_are_refused(model):
    config = EngineConfig(max_batch=4, max_seq_len=48, max_new_tokens=24, compile="auto", compile_buckets=[(1, 1)])
    with pytest.raises(ValueError, match=r"engine\.compile_buckets set the shapes of CUDA graphs; on CPU one decode "
                                         r"graph takes every batch"):
        Engine(model, config)


def test_a_plan_that_cannot_fit_beside_the_compile_workers_is_refused_at_start_naming_the_settings(model):
    config = EngineConfig(max_batch=4, max_seq_len=48, max_new_tokens=24, prefill_chunk=16, compile="auto",
                          compile_workers=2)
    plan = Engine(model, config.model_copy(update={"compile": "off"}), free_bytes=2**40).memory
    assert plan.compile_bytes == 0
    with pytest.raises(ValueError, match=r"memory plan does not fit: .* \+ 2 compile worker\(s\) x 3072 MiB need .*; "
                                         r"lower engine\.kv_cache_memory or engine\.max_batch, "
                                         r"engine\.compile_workers, or set engine\.compile: off"):
        Engine(model, config, free_bytes=2 * 3 * 2**30)
    assert Engine(model, config.model_copy(update={"compile": "off"}), free_bytes=2 * 3 * 2**30).max_batch == 4


def test_prefill_chunk_is_bounded():
    with pytest.raises(ValueError, match="prefill_chunk 1000000 exceeds 8192"):
        EngineConfig(prefill_chunk=10**6)
    with pytest.raises(ValueError, match="prefill_chunk 9000 exceeds 8192 .*here 4096"):
        EngineConfig(max_seq_len=4096, prefill_chunk=9000)
    # generate()'s one-request engine prefills a whole long prompt: allowed where max_seq_len holds it
    assert EngineConfig(max_seq_len=20000, prefill_chunk=10000).prefill_chunk == 10000


def test_prefill_chunk_longer_than_a_sequence_allocates_only_max_seq_len(model):
    engine = Engine(model, EngineConfig(max_batch=1, max_seq_len=64, max_new_tokens=8, prefill_chunk=4096))
    assert engine.runner.buffers._causal.shape == (64, 64) and engine.runner.buffers.prefill_mask.shape[2] == 64
    assert engine.scheduler.prefill_chunk == 64
    engine.add_request(req(0, list(range(2, 30)), 4))
    out = []
    while engine.has_work():
        out += [t for o in engine.step() for t in o.tokens]
    assert len(out) == 4


@pytest.mark.parametrize("tokens", [0, 2, 64])
def test_history_tokens_zero_or_at_least_two(tokens):
    assert EngineConfig(history_tokens=tokens).history_tokens == tokens


def test_history_tokens_one_is_refused_by_the_config():
    with pytest.raises(ValueError, match="history_tokens must be 0 .* or at least 2"):
        EngineConfig(history_tokens=1)


def test_without_a_kv_budget_the_slots_must_fit_free_memory(model):
    config = EngineConfig(max_batch=4)  # max_seq_len: the model's context, 1024
    need = Engine(model, config, free_bytes=2**40).memory.needed_bytes  # the learned tables share the free memory
    with pytest.raises(ValueError, match=r"without an engine\.kv_cache_memory budget .*max_batch=4 .*"
                                         r"is free after .* MiB of learned tables; set engine\.kv_cache_memory "
                                         r".*engine\.max_seq_len"):
        Engine(model, config, free_bytes=need - 1)
    assert Engine(model, config, free_bytes=need).kv_plan.slots == 4


def test_the_learned_tables_come_out_of_free_memory_before_the_kv(model):
    """History ring and index, successor table and the shared pool's bound: counted in the plan,
    so a fraction of free memory is a fraction of what they leave."""
    small = EngineConfig(max_batch=64, max_seq_len=64, kv_cache_memory=0.5, history_tokens=0, shared_pool_cap=0)
    big = small.model_copy(update={"history_tokens": 2**20, "shared_pool_cap": 8})
    per_slot = Engine(model, small, free_bytes=2**40).kv_plan.bytes_per_slot
    learned = Engine(model, big, free_bytes=2**40).kv_plan.learned_bytes
    beside = Engine(model, big, free_bytes=2**40).memory.beside_kv_bytes  # buffers and the widest step
    assert learned > 2**20 * 8 * 3  # the ring and one hash table per match length, 16 bytes a slot
    free = learned + beside + 40 * per_slot
    assert Engine(model, small, free_bytes=free).kv_plan.slots > Engine(model, big, free_bytes=free).kv_plan.slots
    assert Engine(model, big, free_bytes=free).kv_plan.slots == 20 - 1  # half of the 40 left, less the prefixes
    assert "learned tables up to" in Engine(model, big, free_bytes=free).kv_plan.describe()
    with pytest.raises(ValueError, match=r"learned tables can grow to .* MiB but .* MiB is free; lower "
                                         r"engine\.history_tokens, engine\.shared_pool_keys"):
        Engine(model, big, free_bytes=learned + beside)


def test_successor_topk_above_the_vocabulary_is_refused_at_init(model):
    with pytest.raises(ValueError, match="engine.successor_topk 64 exceeds the model's vocabulary of 32 tokens"):
        Engine(model, EngineConfig(max_batch=1, max_seq_len=64, successor_topk=64))
    engine = Engine(model, EngineConfig(max_batch=1, max_seq_len=64, max_new_tokens=8, successor_topk=32))
    engine.add_request(req(0, [2, 3, 4, 5], 6, LookaheadParams(3, 2, 2)))
    while engine.has_work():
        engine.step()


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_above_the_vocabulary_are_refused_per_request(field):
    small = build_random_model("llama", vocab_size=16)  # below MAX_TOP_LOGPROBS
    engine = Engine(small, EngineConfig(max_batch=1, max_seq_len=64, max_new_tokens=8, successor_topk=8))
    with pytest.raises(ValueError, match="20 logprobs per token exceed the model's vocabulary of 16"):
        engine.add_request(req(0, [2, 3, 4, 5], 6, **{field: 20}))
    engine.add_request(req(1, [2, 3, 4, 5], 6, **{field: 5}))
    while engine.has_work():
        engine.step()


def _readme_gpu_engine() -> EngineConfig:
    """The engine of README's GPU example: the yaml block that sets compile_buckets."""
    blocks = re.findall(r"```yaml\n(.*?)```", README.read_text(), flags=re.S)
    block = next(b for b in blocks if "compile_buckets" in b)
    return EngineConfig.model_validate(yaml.safe_load(block)["args"]["engine"])


def test_readme_gpu_example_figures_are_the_kv_arithmetic():
    """Llama-2-7B in float16 with ~66 GiB free after the weights on an 80 GB card: the slots
    README states, and its [32, 16] bucket compiled at that slot count instead of failing."""
    cfg = _readme_gpu_engine()
    assert cfg.max_step_tokens == 273
    capacity = cfg.max_seq_len + cfg.max_step_tokens
    plan = plan_kv(cfg.max_batch, capacity, LLAMA2_7B_FP16_KV_PER_TOKEN, cfg.max_step_tokens * capacity * 2,
                   cfg.kv_cache_memory, free_bytes=66 * 2**30, reserved_tokens=cfg.prefix_cache_tokens)
    assert (plan.slots, plan.capacity_tokens) == (26, 4369)
    text = " ".join(README.read_text().split())
    assert f"KV cache: {plan.slots} slots x {plan.capacity_tokens} tokens x 512.0 KiB" in text
    assert f"{plan.bytes_per_slot / 2**30:.2f} GiB a slot" in text
    assert cfg.buckets_within(plan.slots) == ((1, 1), (8, 1), (26, 16))
    assert "`[32, 16]` as `[26, 16]`" in text

"""size_engine's graphs: on CPU one decode graph of every batch and width and one for prompt
chunks; on CUDA the fixed shapes, none beyond the KV slots."""
import logging

import pytest
import torch

from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.runner import sizing as engine_module
from lookahead_core.engine.runner.sizing import graph_buckets
from lookahead_core.models.random_models import build_random_model


@pytest.fixture(scope="module")
def model():
    return build_random_model("llama", vocab_size=32)


def test_cuda_graph_shapes_beyond_the_kv_slots_are_captured_at_the_slot_count(model, caplog):
    """On CUDA, compile_buckets are the fixed shapes of CUDA graphs: one of more sequences than the
    plan's slots is captured at the slot count (read on a CPU engine as a CUDA one would)."""
    config = EngineConfig(max_batch=4, max_seq_len=48, max_new_tokens=24, prefill_chunk=16, kv_cache_memory="700KiB",
                          prefix_cache_tokens=0, compile="on", compile_buckets=[(1, 1), (4, 1), (4, 8)],
                          compile_kv=[64])
    engine = Engine(model, config.model_copy(update={"compile": "off"}))
    assert engine.max_batch == 1
    engine.runner.device = torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger=engine_module.log.name):
        buckets = graph_buckets(config, "cuda", engine.max_batch, engine.runner.cache.capacity, 16)
    assert [(b.batch, b.width, b.kv, b.dynamic) for b in buckets] == [(1, 1, 64, False), (1, 8, 64, False)]
    warnings = [r.getMessage() for r in caplog.records if "compile_buckets" in r.getMessage()]
    assert len(warnings) == 1 and "batch 4 exceeds the 1 KV slots" in warnings[0]


def test_a_cpu_engine_compiles_one_decode_graph_and_one_for_prompt_chunks(model):
    engine = Engine(model, EngineConfig(max_batch=4, max_seq_len=48, max_new_tokens=24, prefill_chunk=16))
    config = EngineConfig(max_batch=4, max_seq_len=48, max_new_tokens=24, prefill_chunk=16, compile="auto",
                          compile_max_width=8)
    buckets = graph_buckets(config, "cpu", 4, engine.runner.cache.capacity, 16)
    capacity = engine.runner.cache.capacity
    assert [(b.batch, b.width, b.kv, b.prefill, b.dynamic) for b in buckets] == [
        (4, 8, capacity - 1, False, True), (1, 16, capacity - 1, True, True)]

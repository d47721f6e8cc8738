"""bench_step_profile: the profiled step's categories cover its whole time, on a tiny random model."""
import pytest

from benchmarks import bench_step_profile
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.models.random_models import build_random_model


def test_categories_sum_to_the_profiled_total():
    model = build_random_model("llama")
    engine = Engine(model, EngineConfig(max_batch=2, max_seq_len=64, prefill_chunk=32))
    out = bench_step_profile.run_shape(engine, 2, 4, keys=12, steps=2, warmup=1, profile_steps=1)
    cats = out["categories"]
    assert sum(cats.values()) == pytest.approx(out["profiled_ms"], rel=1e-6)
    for c in ("gemm attn proj", "gemm mlp", "lm_head", "attention core", "norms", "rotary", "kv write",
              "argmax/topk + transfer", "mask & position staging"):
        assert cats.get(c, 0.0) > 0, c
    cols = bench_step_profile.host_columns(out["ms"])
    assert cols["forward"] > 0 and cols["step"] >= cols["forward"]
    assert not engine.has_work()
    # the wrappers are gone: the engine's and the model's own methods again
    assert "step" not in vars(engine) and "_plan" not in vars(engine) and "forward" not in vars(model)

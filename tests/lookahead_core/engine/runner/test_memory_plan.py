"""The memory plan: what the engine's process holds once it has served steps of every shape, what
must be free beside it at start, and a refusal that names the settings."""
import pytest

from lookahead_core.engine.runner.memory_plan import MemoryPlan, plan_kv

MIB = 2**20


def _plan(**kw) -> MemoryPlan:
    kv = plan_kv(4, 100, MIB, 0, None, None)  # 4 slots x 100 tokens x 1 MiB
    parts = dict(process_bytes=700 * MIB, weights_bytes=300 * MIB, kv=kv, buffers_bytes=3 * MIB, learned_bytes=2 * MIB,
                 graphs=2, graph_code_bytes=32 * MIB, step_peak_bytes=96 * MIB, compile_bytes=1024 * MIB,
                 compile_workers=2, kernel_cache_bytes=192 * MIB)
    return MemoryPlan(**{**parts, **kw})


def test_the_steady_process_counts_the_widest_step_and_the_cached_kernels():
    plan = _plan()
    assert plan.steady_bytes == (700 + 400 + 3 + 2 + 32 + 96 + 192) * MIB
    assert plan.needed_bytes == plan.steady_bytes - 700 * MIB + 2 * 1024 * MIB  # the workers beside it while compiling
    d = plan.as_dict()
    assert d["predicted_rss_mb"] == 1425.0 and d["kernel_cache_mb"] == 192.0 and d["step_peak_mb"] == 96.0


def test_a_plan_that_cannot_fit_is_refused_naming_the_settings():
    plan = _plan()
    plan.check(plan.needed_bytes)  # fits exactly
    with pytest.raises(ValueError, match=r"cached GEMM kernels 192 MiB.*engine.kv_cache_memory.*engine.compile_workers"):
        plan.check(plan.needed_bytes - 1)

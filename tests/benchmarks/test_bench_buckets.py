"""bench_buckets: a one-token step's cost per batch in its own compiled graph, by GEMM choice."""
import pytest
import torch
import yaml

from benchmarks import bench_buckets
from lookahead_core.engine.compiled_forward import CompiledForward


@pytest.mark.compile
def test_each_choice_times_steps_in_its_graph(tiny_model_dir, tmp_path):
    config = tmp_path / "serve.yaml"
    engine = {"max_batch": 4, "max_seq_len": 96, "max_new_tokens": 64, "prefill_chunk": 16, "kv_cache_memory": "8MiB"}
    config.write_text(yaml.safe_dump({"applications": [{"args": {
        "model": {"path": str(tiny_model_dir), "dtype": "float32"}, "engine": engine, "torch_threads": 1}}]}))
    threads = torch.get_num_threads()
    try:  # it applies the config's core plan to this process
        report = bench_buckets.main(["--config", str(config), "--batches", "4", "--gemm", "rule,autotune",
                                     "--prompt-tokens", "8", "--steps", "3", "--json", str(tmp_path / "b.json")])
    finally:
        torch.set_num_threads(threads)
    assert (report["dtype"], report["torch_threads"]) == ("float32", 1) and report["cpu_capability"]
    rows = {(r["gemm"], r["batch"]): r for r in report["rows"]}
    assert set(rows) == {("rule", 4), ("autotune", 4)}
    assert all(r["compiled_steps"] == 3 and r["step_ms"] > 0 for r in rows.values())  # every timed step in the graph
    backends = {key: r["gemm_backends"] for key, r in rows.items()}
    assert backends == {("rule", 4): "CPP", ("autotune", 4): "CPP,ATEN"}
    assert CompiledForward.options_for is bench_buckets.RULE  # the engine's own rule back in place
    assert (tmp_path / "b.json").exists()


def test_an_unknown_choice_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_buckets.main(["--gemm", "rule,fastest"])
    assert "unknown ['fastest']" in capsys.readouterr().err

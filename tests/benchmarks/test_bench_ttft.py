"""bench_ttft: each mode's first-token latency, new prompts and repeats, from one engine."""
from benchmarks import bench_ttft


def test_it_reports_each_mode_new_and_repeated(tiny_model_dir, tmp_path):
    report = bench_ttft.main(["--model", str(tiny_model_dir), "--dtype", "float32", "--num-prompts", "2",
                              "--max-new-tokens", "2", "--json", str(tmp_path / "ttft.json")])
    for key in ("off/new", "off/repeat", "auto/new", "auto/repeat"):
        assert report[key] > 0
    assert report["dtype"] == "torch.float32" and report["cpu_capability"]
    assert (tmp_path / "ttft.json").exists()

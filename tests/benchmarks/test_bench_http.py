"""bench_http against the session's real Serve app: every phase runs, and the ratios are of what it measured."""
from benchmarks import bench_http


def test_auto_and_off_alternate_and_are_compared(server, tmp_path):
    report = bench_http.main(["--url", server, "--users", "2", "--duration", "1.5", "--max-new-tokens", "6",
                              "--num-prompts", "3", "--json", str(tmp_path / "http.json")])
    (level,) = report["levels"]
    assert [p["mode"] for p in level["phases"]] == ["auto", "off", "off", "auto"]
    assert level["errors"] == 0, [p["error_samples"] for p in level["phases"]]
    assert all(p["requests"] >= 1 and p["tokens"] >= p["requests"] for p in level["phases"])
    auto, off = level["auto"]["tokens_per_s"], level["off"]["tokens_per_s"]
    assert level["throughput_ratio"] == round(auto / off, 3)
    assert (tmp_path / "http.json").exists()

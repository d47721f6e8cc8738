"""bench_serving against the session's real Serve app: each level sends every prompt once over
/v1/chat/completions, and the ratios are of what it measured."""
from benchmarks import bench_serving


def test_levels_send_each_prompt_once_and_compare_auto_with_off(server, tmp_path):
    report = bench_serving.main(["--servers", "ours", "--ours-url", server, "--users", "1,3", "--max-tokens", "5",
                                 "--logs", str(tmp_path), "--json", str(tmp_path / "serving.json")])
    rows = report["rows"]
    assert [(r["server"], r["users"]) for r in rows] == [("ours-auto", 1), ("ours-off", 1), ("ours-auto", 3),
                                                           ("ours-off", 3)]  # the modes side by side
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == bench_serving.prompts_per_level(r["users"], 96)
        assert r["requests"] <= r["tokens"] <= 5 * r["requests"]
        assert 0 < r["ttft"]["p50"] <= r["latency"]["p50"] and r["tokens_per_s"] > 0
    auto, off = rows[2]["tokens_per_s"], rows[3]["tokens_per_s"]
    assert f"auto/off tok/s {auto / off:.2f}x" in report["ratios"][1]
    assert report["health"]["model"] == "tiny" and (tmp_path / "serving.json").exists()

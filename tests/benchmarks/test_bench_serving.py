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
    assert all(isinstance(r["step_costs_ms"], dict) for r in rows)  # each level's own forwards, their mean
    assert rows[1]["step_forwards"]["b1t1"] > 0 and rows[1]["step_costs_ms"]["b1t1"] > 0  # "off", one user: one-token steps
    assert report["served_steps"] == bench_serving.served_against_alone(rows, report["health"])


def test_served_steps_hold_each_level_against_its_batch_timed_alone():
    health = {"compiled_decode": {"buckets": [{"batch": 1, "alone_ms": {"1": 20.0}}, {"batch": 4, "alone_ms": {"1": 25.0}},
                                              {"batch": 8, "alone_ms": {"4": 40.0}}, {"batch": 16, "alone_ms": {}}]}}
    rows = [{"server": "ours-auto", "users": 1, "step_costs_ms": {"b1t1": 23.0, "b4t1": 99.0}},
            {"server": "ours-off", "users": 3, "step_costs_ms": {"b4t1": 30.0}},  # 3 users step in the batch-4 bucket
            {"server": "ours-auto", "users": 8, "step_costs_ms": {"b8t1": 50.0}},  # no one-token timing alone
            {"server": "ours-auto", "users": 16, "step_costs_ms": {}},
            {"server": "vllm", "users": 1, "tokens_per_s": 30.0},
            {"server": "in-process-off", "users": 1, "step_costs_ms": {"b1t1": 21.0}}]  # not served
    assert bench_serving.served_against_alone(rows, health) == [
        "ours-auto      1 users: b1t1 served 23.0 ms, alone 20.0 ms: 1.15x",
        "ours-off       3 users: b4t1 served 30.0 ms, alone 25.0 ms: 1.20x"]


def test_level_costs_are_the_mean_of_the_forwards_between_two_reads():
    before = {"b1t1": (100.0, 10), "b4t1": (60.0, 2)}
    after = {"b1t1": (160.0, 13), "b4t1": (60.0, 2), "b8t1": (90.0, 3)}  # b4t1 did not run; b8t1 first ran
    assert bench_serving.level_costs(before, after) == ({"b1t1": 20.0, "b8t1": 30.0}, {"b1t1": 3, "b8t1": 3})

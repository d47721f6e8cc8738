"""bench_serving against the session's real Serve app: each level sends every prompt once over
/v1/chat/completions, and the ratios are of what it measured."""
import torch

from benchmarks import bench_serving

from ..conftest import TINY_CHAT_TEMPLATE


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
        assert r["tokens_per_step"] >= 1.0 and (r["server"] == "ours-auto" or r["tokens_per_step"] == 1.0)
    auto, off = rows[2]["tokens_per_s"], rows[3]["tokens_per_s"]
    assert f"auto/off tok/s {auto / off:.2f}x" in report["ratios"][1]
    assert report["health"]["model"] == "tiny" and (tmp_path / "serving.json").exists()
    assert all(isinstance(r["step_costs_ms"], dict) for r in rows)  # each level's own forwards, their mean
    assert rows[1]["step_forwards"]["b1t1"] > 0 and rows[1]["step_costs_ms"]["b1t1"] > 0  # "off", one user: one-token steps
    assert report["served_steps"] == bench_serving.served_steps(rows, report["health"])


def test_served_steps_hold_each_level_against_in_process_and_alone():
    health = {"compiled_decode": {"buckets": [  # one decode graph timed alone at each (batch, width) cell
        {"batch": 16, "width": 64, "alone_ms": {"b1t1": 20.0, "b4t1": 25.0, "b8t4": 40.0}},
        {"batch": 1, "width": 128, "prefill": True, "alone_ms": {"b1t1": 5.0}}]}}  # prefill cells are not steps
    rows = [{"server": "in-process-auto", "users": 1, "step_costs_ms": {"b1t1": 21.0}, "step_forwards": {"b1t1": 40}},
            {"server": "in-process-off", "users": 3, "step_costs_ms": {"b4t1": 24.0}},
            {"server": "in-process-auto", "users": 8, "step_costs_ms": {"b8t1": 40.0}},
            {"server": "ours-auto", "users": 1, "step_costs_ms": {"b1t1": 23.1, "b4t1": 99.0}, "step_forwards": {"b1t1": 37}},
            {"server": "ours-off", "users": 3, "step_costs_ms": {"b4t1": 30.0}},  # 3 users step in the batch-4 bucket
            {"server": "ours-off", "users": 8, "step_costs_ms": {"b8t1": 50.0}},  # neither in-process off nor alone
            {"server": "ours-auto", "users": 8, "step_costs_ms": {"b8t1": 50.0}},  # in-process only
            {"server": "ours-auto", "users": 16, "step_costs_ms": {}},
            {"server": "vllm", "users": 1, "tokens_per_s": 30.0}]
    assert bench_serving.served_steps(rows, health) == [
        "ours-auto      1 users: b1t1 served 23.1 ms (37 forwards), in-process 21.0 ms (40 forwards): 1.10x, alone 20.0 ms: 1.16x",
        "ours-off       3 users: b4t1 served 30.0 ms, in-process 24.0 ms: 1.25x, alone 25.0 ms: 1.20x",
        "ours-auto      8 users: b8t1 served 50.0 ms, in-process 40.0 ms: 1.25x"]


def test_in_process_levels_drive_the_served_engine_as_the_served_levels(tiny_model_dir):
    app = {"model": {"path": str(tiny_model_dir), "name": "tiny", "dtype": "float32", "chat_template": TINY_CHAT_TEMPLATE},
           "engine": {"max_batch": 4, "max_seq_len": 256, "max_new_tokens": 64, "prefill_chunk": 32,
                      "lookahead": {"n": 3, "w": 3, "g": 3}, "compile": "off"},
           "num_cpus": 1}
    threads = torch.get_num_threads()
    try:
        rows = bench_serving.in_process(app, ["abc", "hello there", "xyz"], [1, 2], ["auto", "off"], 6)
    finally:
        torch.set_num_threads(threads)  # the core plan set this process's threads
    assert [(r["server"], r["users"]) for r in rows] == [("in-process-auto", 1), ("in-process-off", 1),
                                                           ("in-process-auto", 2), ("in-process-off", 2)]
    for r in rows:
        assert 3 <= r["tokens"] <= 3 * 6 and r["tokens_per_s"] > 0  # each of the 3 prompts once, EOS or 6 tokens
        assert sum(r["step_forwards"].values()) > 0 and all(ms > 0 for ms in r["step_costs_ms"].values())
    assert rows[1]["step_forwards"]["b1t1"] > 0  # "off", one in flight: one-token steps of one sequence


def test_level_costs_are_the_mean_of_the_forwards_between_two_reads():
    before = {"b1t1": (100.0, 10), "b4t1": (60.0, 2)}
    after = {"b1t1": (160.0, 13), "b4t1": (60.0, 2), "b8t1": (90.0, 3)}  # b4t1 did not run; b8t1 first ran
    assert bench_serving.level_costs(before, after) == ({"b1t1": 20.0, "b8t1": 30.0}, {"b1t1": 3, "b8t1": 3})


def test_the_memory_line_holds_the_engine_process_against_its_plan():
    health = {"replica": {"rss_mb": 2033.6999999999998, "engine_rss_mb": 1547.3},
              "memory_plan": {"predicted_rss_mb": 1187.6, "weights_mb": 310.6, "kv_cache_mb": 411.8, "graphs": 2}}
    assert bench_serving.memory_line(health) == ("replica's processes 2033.7 MiB (engine process 1547.3 MiB, planned "
                                                 "1187.6 MiB, 1.30x the plan: weights 310.6, KV 411.8, graphs 2)")
    assert "x the plan" not in bench_serving.memory_line({"replica": {"rss_mb": None}})

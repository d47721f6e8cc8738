"""The real open-loop router benchmark, shrunk: every policy replays the same schedule each round."""
from benchmarks.bench_router import main


def test_open_loop_benchmark_replays_one_schedule_per_policy_and_round(tmp_path):
    res = main(["--model", "random:tiny", "--prompts", "", "--rates", "2,400", "--requests", "3", "--min-arrival-s", "0.02",
                "--rounds", "2", "--max-new-tokens", "6", "--max-batch", "4", "--fixed", "3,2,2",
                "--json", str(tmp_path / "r.json")])
    assert set(res["results"]) == {"plain", "fixed(3,2,2)", "goodput"}
    for by_rate in res["results"].values():
        # 3 requests at 2 req/s; at 400 req/s the 0.02 s arrival span asks for 8; two rounds each
        assert by_rate["2.0"]["requests"] == 6 and by_rate["400.0"]["requests"] == 16
        assert all(r["throughput_tok_s"] > 0 for r in by_rate.values())
    assert res["results"]["fixed(3,2,2)"]["2.0"]["choices"] == {"3,2,2": 1.0}
    assert set(res["checks"]["p50_vs_plain"]) == {"2.0", "400.0"}
    assert (tmp_path / "r.json").stat().st_size > 0

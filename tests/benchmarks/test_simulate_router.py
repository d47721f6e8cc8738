"""The router simulation on a synthetic CPU-like profile: the policy does what it claims."""
from benchmarks.simulate_router import main
from tests.lookahead_core.policy.test_controller import cpu_like_profile


def test_goodput_policy_beats_plain_when_idle_and_matches_it_when_busy(tmp_path):
    profile = tmp_path / "p.yaml"
    cpu_like_profile().save(profile)
    res = main(["--profile", str(profile), "--rates", "2,200", "--requests", "200", "--out-tokens", "64",
                "--fixed", "4,5,5;3,2,2", "--png", str(tmp_path / "sim.png")])
    low, high = 2.0, 200.0
    assert res["goodput"][low]["p50_latency_s"] <= 0.8 * res["plain"][low]["p50_latency_s"]
    assert res["goodput"][high]["throughput_tok_s"] >= 0.95 * res["plain"][high]["throughput_tok_s"]
    # under heavy load the wide fixed setting falls far behind: the trade the router exists for
    assert res["fixed(4,5,5)"][high]["throughput_tok_s"] < 0.5 * res["plain"][high]["throughput_tok_s"]
    assert (tmp_path / "sim.png").stat().st_size > 10_000

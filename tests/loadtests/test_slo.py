import pytest

from loadtests.slo import SloConfig, table, verdict

FIGS = {"ttft": {"count": 10, "p50": 100, "p90": 200, "p95": 300, "p99": 400},
        "output_tokens_per_s": {"count": 10, "p50": 20, "p90": 30, "p95": 35, "p99": 40}}


def test_met_and_breached_percentiles():
    ok = SloConfig(entries={"ttft": {"p50": 150, "p95": 300}})
    assert verdict(ok, FIGS, requests=10, error_rate=0.0) == []
    bad = SloConfig(entries={"ttft": {"p95": 250}, "output_tokens_per_s": {"min_p50": 25}})
    assert verdict(bad, FIGS, requests=10, error_rate=0.0) == ["ttft p95 300.0 > 250", "output_tokens_per_s p50 20.0 < 25"]


def test_errors_missing_entries_and_too_few_requests():
    cfg = SloConfig(max_error_rate=0.01, min_requests=5, entries={"tpot": {"p50": 10}})
    got = verdict(cfg, FIGS, requests=3, error_rate=0.5)
    assert got == ["error rate 50.00% > 1.00%", "3 completed requests < 5", "tpot: no measurements"]


def test_unknown_entries_are_refused(tmp_path):
    path = tmp_path / "slo.yaml"
    path.write_text("entries:\n  latency: {p50: 10}\n")
    with pytest.raises(ValueError, match="unknown SLO entries"):
        SloConfig.load(path)


def test_table_lists_entries_and_bounds():
    text = table(SloConfig(entries={"ttft": {"p95": 300}}), FIGS)
    assert "ttft" in text and "p95<=300" in text and "output_tokens_per_s" in text

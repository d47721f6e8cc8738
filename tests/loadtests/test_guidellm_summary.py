import json

from loadtests import guidellm_summary


def _stat(median, p95):
    return {"successful": {"median": median, "mean": median, "percentiles": {"p95": p95}}}


def _report(errored):
    metrics = {key: _stat(10.0, 20.0) for key, _ in guidellm_summary.METRICS}
    metrics["request_totals"] = {"successful": 32 - errored, "errored": errored, "incomplete": 0, "total": 32}
    metrics["output_tokens_per_second"] = _stat(11.93, 0)
    return {"benchmarks": [{"config": {"strategy": {"type_": "concurrent", "streams": 4}}, "metrics": metrics}]}


def test_summary_and_exit_code_follow_the_errors(tmp_path, capsys):
    ok, bad = tmp_path / "ok.json", tmp_path / "bad.json"
    ok.write_text(json.dumps(_report(0)))
    bad.write_text(json.dumps(_report(3)))
    assert guidellm_summary.main([str(ok)]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["streams"] == 4 and row["successful"] == 32 and row["TTFT ms"] == {"p50": 10.0, "p95": 20.0}
    assert guidellm_summary.main([str(bad)]) == 1

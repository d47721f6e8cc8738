"""Real locust against the real Serve app: a met SLO exits 0, any breach exits non-zero."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_locust(server, prompts, slo_text, tmp_path, seconds=6, lookahead="auto"):
    slo = tmp_path / "slo.yaml"
    slo.write_text(slo_text)
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless", "-u", "2", "-r", "2",
           "-t", f"{seconds}s", "--host", server, "--slo-file", str(slo), "--prompt-set", str(prompts), "--lookahead", lookahead,
           "--max-new-tokens", "12", "--summary-json", str(summary), "--only-summary", "--stop-timeout", "20"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return proc, json.loads(summary.read_text())


def test_met_slo_exits_zero_and_records_every_entry(server, prompts, tmp_path):
    proc, summary = run_locust(server, prompts, "max_error_rate: 0\nentries:\n  ttft: {p95: 60000}\n  tpot: {p95: 60000}\n", tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "SLO: met" in proc.stdout
    assert summary["failures"] == 0 and summary["requests"] >= 2
    assert set(summary["figures"]) == {"ttft", "tpot", "e2e", "output_tokens_per_s"}
    assert summary["tokens"] > 0 and summary["met_slo"] == summary["requests"]


@pytest.mark.parametrize("slo", ["entries:\n  ttft: {p50: 0.001}\n", "entries:\n  tpot: {p95: 0.001}\n",
                                 "entries:\n  output_tokens_per_s: {min_p50: 1000000}\n", "min_requests: 100000\n"])
def test_any_breach_exits_non_zero(server, prompts, tmp_path, slo):
    # "off": one token per step, so every request has a time per output token however fast the
    # host (with lookahead all 12 tokens may come in one step: a TPOT of 0 meets any bound)
    proc, summary = run_locust(server, prompts, slo, tmp_path, seconds=4, lookahead="off")
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "SLO: BREACHED" in proc.stdout and summary["breaches"]
    assert all(figure[p] > 0 for figure in summary["figures"].values() for p in ("p50", "p95"))  # exact, not whole ms

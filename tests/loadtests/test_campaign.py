"""A campaign against the session's real Serve app: every stage under every policy, then its report."""
from pathlib import Path

import yaml

from loadtests import campaign

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_campaign_against_the_server(server, prompts, tmp_path):
    cfg = yaml.safe_load((ROOT / "loadtests" / "campaigns" / "smoke.yaml").read_text())
    cfg["prompt_set"] = str(prompts)
    path = tmp_path / "smoke.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code = campaign.main(["--config", str(path), "--host", server, "--out", str(tmp_path / "report")])
    assert code == 0
    report = (tmp_path / "report" / "README.md").read_text()
    assert "| off | 2 |" in report and "| auto | 2 |" in report
    assert (tmp_path / "report" / "latency_throughput.png").stat().st_size > 10_000

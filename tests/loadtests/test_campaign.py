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


def test_every_shipped_campaign_reads():
    """Each file under loadtests/campaigns is a valid campaign: its SLO file, prompt set and policies."""
    from loadtests.client import lookahead_field, read_prompts

    files = sorted((ROOT / "loadtests" / "campaigns").glob("*.yaml"))
    assert len(files) >= 3
    for path in files:
        c = campaign.Campaign.model_validate(yaml.safe_load(path.read_text()))
        assert (ROOT / c.slo).exists(), path.name
        assert read_prompts(c.prompt_set), path.name
        assert all(lookahead_field(p) for p in c.policies), path.name

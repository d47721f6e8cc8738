"""A campaign against the session's real Serve app: every stage under every policy, then its report."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from loadtests import campaign
from tests.fixtures import wait_until

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


def test_stop_server_stops_the_server_then_what_of_its_group_outlived_it(tmp_path):
    """The server first (SIGTERM, as `serve run` wants it), then its group: a child that
    outlives the server (vLLM's engine core, a HAProxy) is stopped too."""
    child_pid = tmp_path / "child.pid"
    leader = subprocess.Popen([sys.executable, "-c", f"""
import pathlib, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
pathlib.Path({str(child_pid)!r}).write_text(str(child.pid))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the server exits, its child stays
time.sleep(60)
"""], start_new_session=True)
    assert wait_until(lambda: child_pid.exists() and child_pid.read_text(), 10)
    child = int(child_pid.read_text())
    started = time.monotonic()
    campaign.stop_server(leader)
    assert leader.returncode == 0 and time.monotonic() - started < 10  # ended by its own SIGTERM handler
    assert wait_until(lambda: not _alive(child), 10), "the server's child outlived stop_server"


def test_a_start_whose_ports_are_taken_is_refused_naming_what_holds_them(tmp_path):
    """As a HAProxy left by an earlier run held them: the next `serve run` could not bind, and
    /health answered 500 from the stale HAProxy. Refused before `serve run` starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        config = tmp_path / "serve.yaml"
        config.write_text(f"http_options: {{host: 127.0.0.1, port: {port}}}\napplications: []\n")
        with pytest.raises(RuntimeError, match=rf"cannot start serve run .*: HTTP port {port} is held by pid {os.getpid()} "):
            campaign.start_server(str(config), timeout=5)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(") ", 1)[1][0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie, not yet reaped by init, has stopped

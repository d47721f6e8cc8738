"""The overload script against the session's real Serve app: bursts it can hold are all served, and
the report says so (refusals under a real overload: tests/deployments/test_reliability.py)."""
from loadtests import overload


def test_bursts_are_served_or_refused_and_reported(server, capsys):
    assert overload.main(["--url", server, "--bursts", "2", "--concurrency", "3", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert '"problems": []' in out and '"served": 3' in out and '"200": 3' in out

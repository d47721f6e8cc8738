"""Autoscaling on a local multi-node cluster: load takes the model deployment from 1 to 2 replicas
and back to 1 when it stops (cluster/autoscale.py --fast: short delays, 1 s metric pushes), with
deployments.autoscaling's policy, so the replicas' own reports drive it. Both policies with the
shipped settings: `python -m cluster.autoscale` (docs/BENCHMARKS.md, "Running on a cluster")."""
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # the cluster's replicas serve the real model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("autoscale") / "result.json"
    proc = subprocess.run([sys.executable, "-m", "cluster.autoscale", "--fast", "--policies", "engine_queue",
                           "--users", "8", "--max-tokens", "32", "--hold-s", "8", "--timeout-s", "120",
                           "--out", str(out)], check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    print(json.dumps(results, indent=1))
    return results


@pytest.fixture(scope="module")
def scaled(runs):
    (result,) = runs
    return result


def test_load_adds_a_replica_and_it_serves(scaled):
    assert scaled["scale_out_decided_s"] is not None and scaled["scale_out_running_s"] is not None
    assert ["RUNNING", "RUNNING"] in [states for _, states in scaled["timeline"]]
    after = scaled["after_second_replica"]
    assert after["requests"] > 0 and after["errors"] == 0


def test_the_replica_goes_when_the_load_stops(scaled):
    assert scaled["scale_in_s"] is not None
    assert scaled["timeline"][-1][1] == ["RUNNING"]
    assert scaled["request_after_scale_in_ok"]


def test_no_request_fails_while_scaling(scaled):
    assert scaled["errors"] == 0, scaled["error_messages"]

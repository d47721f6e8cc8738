"""A local multi-node Ray cluster (head plus two one-replica worker nodes) loses a worker node under
streaming traffic. Runs cluster/node_failover.py in its own process: this session's tests hold
their own Ray instance, and a driver belongs to one cluster."""
import json
import subprocess
import sys

import pytest

from deployments.ingress import REPLICA_LOST

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # the cluster's replicas serve the real model


@pytest.fixture(scope="module")
def failover(tmp_path_factory):
    out = tmp_path_factory.mktemp("failover") / "result.json"
    proc = subprocess.run([sys.executable, "-m", "cluster.node_failover", "--users", "6", "--before-s", "6",
                           "--after-s", "8", "--max-tokens", "32", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    return result


def test_replicas_land_on_the_worker_nodes_and_the_api_on_the_head(failover):
    nodes = failover["replica_nodes"]
    assert len(set(nodes)) == 2 and failover["head_node"] not in nodes
    assert failover["ingress_node"] == failover["head_node"]


def test_only_requests_in_flight_on_the_lost_node_fail_with_a_clear_error(failover):
    """Those that had streamed from the lost replica fail with REPLICA_LOST; those that had no token
    yet are sent again and succeed, so none may fail at all; the other replica's always finish."""
    assert failover["in_flight_at_removal"] >= 2
    assert failover["failed"] <= failover["in_flight_at_removal"] - 1
    assert failover["failed_in_flight_at_removal"] == failover["failed"]
    assert failover["errors"] == ([REPLICA_LOST.message] if failover["failed"] else [])
    assert failover["client_timeouts"] == 0  # none hung, failed or not
    if failover["failed"]:  # with none failed there is no failure latency (p100 None)
        assert failover["failure_latency_s"]["p100"] < 30  # an error, not a hang


def test_new_requests_succeed_on_the_remaining_replica(failover):
    assert failover["started_after_removal"] > 0
    assert failover["started_after_removal_ok"] == failover["started_after_removal"]
    assert failover["probes_ok"] == failover["probes"]
    survivor = [n for n in failover["replica_nodes"] if n != failover["removed_node"]]
    assert failover["replicas_running_after"] == survivor

"""Lose a worker node under traffic: only the requests in flight on it fail, with a clear error
and no hang, and the next requests succeed on the replica that is left.

    python -m cluster.node_failover [--users 4] [--before-s 20] [--after-s 20] [--out result.json]

Prints one JSON summary (tests/cluster/test_cluster.py runs a short variant and checks it).
"""
from __future__ import annotations

import argparse
import time

from loadtests.client import ClosedLoop, generate, percentiles

from .local_cluster import APP, LocalCluster, chat_requests, free_port, load_config, report


def warm_up(url: str, replicas: int, max_tokens: int) -> None:
    """Concurrent requests until each replica has decoded once (the first forward is slow)."""
    ClosedLoop(url, 2 * replicas, chat_requests(max_tokens), timeout_s=120).run(1)


def run(users: int, before_s: float, after_s: float, max_tokens: int, probes: int) -> dict:
    with LocalCluster(workers=2) as cluster:
        t0 = time.time()
        url = cluster.deploy(load_config(port=free_port(), num_replicas=2))
        deploy_s = time.time() - t0
        placed = cluster.running_replicas()
        ingress = cluster.app()["deployments"]["LookaheadAPI"]["replicas"][0]["node_id"]
        warm_up(url, len(placed), max_tokens)

        body = chat_requests(max_tokens)
        traffic = ClosedLoop(url, users, body, timeout_s=120).start()
        time.sleep(before_s)
        victim = placed[0]
        t_remove = time.time()
        cluster.remove_node(cluster.node_of(victim["node_id"]), pids=(victim["pid"],))
        t_lost = time.time()  # the victim replica's process has exited by now
        time.sleep(after_s)
        outcomes = traffic.stop()

        probe = [generate(url, body(i, 0), timeout_s=120) for i in range(probes)]
        after = cluster.running_replicas()
        status = cluster.app().get("status")

    # The replica dies somewhere in [t_remove, t_lost]: a request that overlaps that window may have
    # been on it; one that starts after it cannot have been.
    in_flight = [o for o in outcomes if o.start < t_lost and o.end > t_remove]
    failed = [o for o in outcomes if not o.ok]
    started_after = [o for o in outcomes if o.start > t_lost]
    return {
        "app": APP,
        "deploy_s": round(deploy_s, 1),
        "head_node": cluster.head_node_id,
        "ingress_node": ingress,
        "replica_nodes": [r["node_id"] for r in placed],
        "removed_node": victim["node_id"],
        "replica_lost_after_s": round(t_lost - t_remove, 2),
        "requests": len(outcomes),
        "in_flight_at_removal": len(in_flight),
        "failed": len(failed),
        "failed_started_before_removal": sum(o.start < t_remove for o in failed),
        "failed_started_while_removing": sum(t_remove <= o.start < t_lost for o in failed),
        "failed_in_flight_at_removal": sum(o in in_flight for o in failed),
        "failure_latency_s": percentiles((o.end - t_remove for o in failed), (50, 100)),
        "errors": sorted({o.error for o in failed if o.error}),
        "client_timeouts": sum(bool(o.error and o.error.startswith("client:")) for o in outcomes),
        "started_after_removal": len(started_after),
        "started_after_removal_ok": sum(o.ok for o in started_after),
        "probes_ok": sum(o.ok for o in probe),
        "probes": probes,
        "replicas_running_after": [r["node_id"] for r in after],
        "app_status_after": status,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--before-s", type=float, default=20, help="traffic before the node is removed")
    p.add_argument("--after-s", type=float, default=20, help="traffic after it")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--probes", type=int, default=4, help="sequential requests once traffic stops")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args()
    result = run(a.users, a.before_s, a.after_s, a.max_tokens, a.probes)
    report(result, a.out)


if __name__ == "__main__":
    main()

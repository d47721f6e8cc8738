"""Autoscaling shown on a local multi-node cluster: closed-loop load takes the model deployment
from 1 to 2 replicas, and it returns to 1 after the load stops. Measures the time to scale out
(decided, and the new replica RUNNING), the time to scale in, and request latency before and
after the second replica is up, for Serve's default policy (in-flight requests at the handles)
and for deployments.autoscaling.engine_queue_policy (the engines' running + waiting sequences).

    python -m cluster.autoscale [--policies default,engine_queue] [--users 8] [--out result.json]

Scaling settings come from configs/serve_cluster.yaml; --fast shortens delays and Ray's metric
push intervals (the CI variant). Prints one JSON summary.
"""
from __future__ import annotations

import argparse
import time

from loadtests.client import ClosedLoop, generate, percentiles

from .local_cluster import LocalCluster, chat_requests, free_port, load_config, report

POLICIES = {"default": None, "engine_queue": "deployments.autoscaling:engine_queue_policy"}
# Ray reads these in its processes; 1 s pushes instead of 10 s for the short CI variant.
FAST_ENV = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
            "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1"}
FAST_SCALING = {"upscale_delay_s": 2, "downscale_delay_s": 6, "look_back_period_s": 3, "metrics_interval_s": 1}


def summarize(outcomes, since: float, until: float) -> dict:
    """Requests started in [since, until); throughput counts the tokens of requests that ended in
    it, per second."""
    chosen = [o for o in outcomes if since <= o.start < until]
    ok = [o for o in chosen if o.ok]
    tokens = sum(o.tokens for o in outcomes if since <= o.end < until)
    return {"requests": len(chosen), "errors": len(chosen) - len(ok),
            "tokens_per_s": round(tokens / max(until - since, 1e-9), 2),
            "latency_s": percentiles(o.latency for o in ok),
            "ttft_s": percentiles(o.ttft for o in ok)}


def wait_for(cluster: LocalCluster, check, timeout_s: float, timeline: list, t0: float) -> float | None:
    """Poll the replicas every 0.25 s, logging changes, until check(replicas); returns when."""
    deadline = time.time() + timeout_s
    last = None
    while time.time() < deadline:
        reps = cluster.replicas()
        states = sorted(r["state"] for r in reps)
        if states != last:
            timeline.append([round(time.time() - t0, 2), states])
            last = states
        if check(reps):
            return time.time()
        time.sleep(0.25)
    return None


def running(reps) -> int:
    return sum(r["state"] == "RUNNING" for r in reps)


def one_policy(policy: str, users: int, max_tokens: int, hold_s: float, fast: bool, timeout_s: float) -> dict:
    scaling = dict(FAST_SCALING) if fast else {}
    if POLICIES[policy]:
        scaling["policy"] = {"policy_function": POLICIES[policy]}
    with LocalCluster(workers=2, env=FAST_ENV if fast else {}) as cluster:
        config = load_config(port=free_port(), autoscaling=scaling)
        url = cluster.deploy(config)
        body = chat_requests(max_tokens)
        for i in range(2):  # the first forwards are slow: keep them out of the figures
            generate(url, body(i, 0), timeout_s=120)
        idle = [generate(url, body(i, 0), timeout_s=120) for i in range(1 if fast else 3)]

        timeline: list = []
        t_load = time.time()
        load = ClosedLoop(url, users, body, timeout_s=120).start()
        t_decided = wait_for(cluster, lambda r: len(r) >= 2, timeout_s, timeline, t_load)
        t_ready = wait_for(cluster, lambda r: running(r) >= 2, timeout_s, timeline, t_load)
        time.sleep(hold_s)
        t_stop = time.time()
        outcomes = load.stop()
        t_drained = time.time()
        t_in = wait_for(cluster, lambda r: len(r) == 1 and running(r) == 1, timeout_s, timeline, t_load)
        after = generate(url, body(0, 0), timeout_s=120)

    def rel(t, base):
        return None if t is None else round(t - base, 1)

    ready = t_ready or t_stop
    return {
        "policy": policy,
        "autoscaling_config": config["applications"][0]["deployments"][0]["autoscaling_config"],
        "users": users,
        "max_tokens": max_tokens,
        "scale_out_decided_s": rel(t_decided, t_load),
        "scale_out_running_s": rel(t_ready, t_load),
        "scale_in_s": rel(t_in, t_drained),
        "idle_latency_s": percentiles(o.latency for o in idle if o.ok),
        "before_second_replica": summarize(outcomes, t_load, ready),
        "after_second_replica": summarize(outcomes, ready, t_stop),
        "errors": sum(not o.ok for o in outcomes),
        "error_messages": sorted({o.error for o in outcomes if o.error}),
        "request_after_scale_in_ok": after.ok,
        "timeline": timeline,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default="default,engine_queue")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--hold-s", type=float, default=30, help="load kept on after the second replica runs")
    p.add_argument("--fast", action="store_true", help="short delays and 1 s metric pushes (CI)")
    p.add_argument("--timeout-s", type=float, default=240, help="give up waiting for a scaling step")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args()
    result = [one_policy(name, a.users, a.max_tokens, a.hold_s, a.fast, a.timeout_s)
              for name in a.policies.split(",")]
    report(result, a.out)


if __name__ == "__main__":
    main()

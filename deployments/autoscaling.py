"""Serve autoscaling on the engine's own queue. Each model replica reports the sequences its
engine holds (LookaheadModel.record_autoscaling_stats); this policy sizes the deployment so each
replica holds `target_ongoing_requests` of them, counting requests still queued at the handles.

    autoscaling_config:
      policy: {policy_function: deployments.autoscaling:engine_queue_policy}

Serve applies min/max_replicas and the up/downscale delays around it, as for its default policy.
"""
from __future__ import annotations

from typing import Any

RUNNING = "engine_running"
WAITING = "engine_waiting"


def engine_queue_policy(ctx: Any) -> tuple[float, dict]:
    """Desired replicas = (running + waiting in the engines + queued at handles) / target."""
    metrics = ctx.aggregated_metrics or {}
    running, waiting = metrics.get(RUNNING, {}), metrics.get(WAITING, {})
    if not running:
        # No replica has reported yet (just deployed): Serve's own in-flight count stands in.
        load = ctx.total_num_requests
    else:
        load = sum(running.values()) + sum(waiting.values()) + (ctx.total_queued_requests or 0)
    return load / ctx.config.get_target_ongoing_requests(), {}

"""engine_queue_policy sizes the deployment from the engines' own queues."""
import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.autoscaling import RUNNING, WAITING, engine_queue_policy


def context(metrics, total=0.0, queued=0.0, replicas=2, target=4):
    ids = [ReplicaID(str(i), DeploymentID("LookaheadModel", "lookahead")) for i in range(replicas)]
    per_replica = {name: dict(zip(ids, values)) for name, values in metrics.items()}
    return AutoscalingContext(
        deployment_id=ids[0].deployment_id, deployment_name="LookaheadModel", app_name="lookahead",
        current_num_replicas=replicas, target_num_replicas=replicas, running_replicas=ids,
        total_num_requests=total, total_queued_requests=queued, aggregated_metrics=per_replica, raw_metrics={},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=None,
        config=AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=target))


def test_counts_running_and_waiting_sequences_and_handle_queues():
    desired, state = engine_queue_policy(context({RUNNING: [4, 4], WAITING: [3, 1]}, total=5, queued=4))
    assert desired == pytest.approx((8 + 4 + 4) / 4) and state == {}


def test_an_idle_deployment_wants_fewer_replicas():
    desired, _ = engine_queue_policy(context({RUNNING: [1, 0], WAITING: [0, 0]}, total=1))
    assert desired == pytest.approx(0.25)


def test_before_any_report_serves_in_flight_count_stands_in():
    desired, _ = engine_queue_policy(context({}, total=12, replicas=1))
    assert desired == pytest.approx(3)

"""What an engine reports of itself, and the replica's status read from it."""
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.host.status import engine_status, health_status
from lookahead_core.models.random_models import build_random_model


def test_a_failed_graph_makes_the_replica_degraded_and_a_health_error_failing():
    status = engine_status(Engine(build_random_model("llama"), EngineConfig(max_batch=2, max_new_tokens=8)))
    assert status["compiled_decode"]["failed"] == 0 and health_status(None, status) == "ok"
    failed = {**status, "compiled_decode": {**status["compiled_decode"], "failed": 1}}
    assert health_status(None, failed) == "degraded"  # its steps run eagerly, 2-3x slower: not "ok"
    assert health_status("the engine process is not running", failed) == "failing"
    assert health_status(None, {}) == "ok"  # no status read yet: the engine's own health decides

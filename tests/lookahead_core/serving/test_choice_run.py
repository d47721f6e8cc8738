"""ChoiceRun's error table: what the engine raises, as the client hears it."""
import pytest

from lookahead_core.engine.engine import EngineOverloaded
from lookahead_core.engine.host.async_engine import EngineStopped, RequestTimeout
from lookahead_core.engine.io import EngineRequest
from lookahead_core.lookahead.stopping import FinishReason, StopCondition
from lookahead_core.serving import RequestError, ServeRequest
from lookahead_core.serving.choice_run import ChoiceRun


def _run(timeout_s=None, own=None):
    req = ServeRequest(input_ids=(1, 2), timeout_s=own)
    ereq = EngineRequest("r", (1, 2), StopCondition(4))
    return ChoiceRun(req, ereq, None, [1, 2], 0, timeout_s, text=None, token_text=str, prompt_text=str)


@pytest.mark.parametrize("exc, status, code", [
    (EngineOverloaded("full"), 503, "overloaded"), (EngineStopped("gone"), 503, "replica_failed"),
    (ValueError("bad"), 400, None), (TypeError("bad"), 400, None), (RuntimeError("step"), 500, None)])
def test_each_engine_error_has_its_status(exc, status, code):
    with pytest.raises(RequestError) as err:
        _run().fail(exc)
    assert err.value.status == status and err.value.code == code and str(exc) in err.value.message


def test_a_deadline_is_408_for_the_clients_own_504_for_the_servers_and_ends_a_started_choice():
    for own, status in ((5.0, 408), (None, 504)):
        with pytest.raises(RequestError) as err:
            _run(timeout_s=5.0, own=own).fail(RequestTimeout())
        assert err.value.status == status and err.value.code == "timeout"
    started = _run(timeout_s=5.0)
    started.tokens.append(7)
    started.fail(RequestTimeout())
    assert started.reason is FinishReason.TIMEOUT

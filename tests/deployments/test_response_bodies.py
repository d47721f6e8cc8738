"""Response bodies in OpenAI's vocabulary. No Ray needed."""
from deployments.response_bodies import OPENAI_FINISH
from lookahead_core.lookahead.stopping import FinishReason


def test_every_finish_reason_has_an_openai_name():
    assert set(OPENAI_FINISH) == set(FinishReason) and OPENAI_FINISH["abort"] == "abort"

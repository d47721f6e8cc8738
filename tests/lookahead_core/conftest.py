"""Fixtures shared across the package's tests: the sampling tests' model and its next-token logits."""
import pytest

from tests.lookahead_core.lookahead.oracles import next_token_logits, sampling_model


@pytest.fixture(scope="session")
def sampler_model():
    """A tiny model whose next-token distributions are far from flat (`oracles.sampling_model`)."""
    return sampling_model()


@pytest.fixture(scope="session")
def logits_table(sampler_model):
    """Its next-token logits after every short context (`oracles.next_token_logits`)."""
    return next_token_logits(sampler_model)

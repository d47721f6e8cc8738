import pytest

from lookahead_core import LookaheadParams


def test_defaults_and_sizes():
    p = LookaheadParams(n=5, w=7, g=3)
    assert p.window_tokens == 28
    assert p.max_step_tokens == 1 + 28 + 3 * 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 1}, "n must be >= 2"),
        ({"w": 0}, "w must be >= 1"),
        ({"g": -1}, "g must be >= 0"),
        ({"n": 2.5}, "n must be an integer"),
        ({"w": True}, "w must be an integer"),
        ({"pool_from_prompt": "yes"}, "pool_from_prompt must be a bool"),
    ],
)
def test_invalid_values_are_rejected_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LookaheadParams(**kwargs)


def test_params_are_hashable_and_frozen():
    p = LookaheadParams(3, 4, 4)
    assert {p: 1}[LookaheadParams(3, 4, 4)] == 1
    with pytest.raises(AttributeError):
        p.n = 4

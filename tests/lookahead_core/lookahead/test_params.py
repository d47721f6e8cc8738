import pytest

from lookahead_core import LookaheadParams


def test_defaults_and_sizes():
    p = LookaheadParams(n=5, w=7, g=3)
    assert p.window_tokens == 28
    assert p.max_candidate_tokens == 3 * 4 + p.lookup + p.successors
    assert p.max_step_tokens == 1 + 28 + 3 * 4 + p.lookup + p.successors
    assert LookaheadParams(5, 7, 3, lookup=0, successors=0).max_step_tokens == 1 + 28 + 3 * 4


def test_parse_takes_three_to_five_integers():
    assert LookaheadParams.parse("4,3,3") == LookaheadParams(4, 3, 3)
    assert LookaheadParams.parse("(3,2,2,0)") == LookaheadParams(3, 2, 2, lookup=0)
    assert LookaheadParams.parse("3,2,2,0,16 fixed") == LookaheadParams(3, 2, 2, lookup=0, successors=16, adapt=False)
    assert LookaheadParams.parse("3,2,2,0").label == "(3,2,2,0)" and LookaheadParams(3, 2, 2).label == "(3,2,2)"
    assert LookaheadParams(3, 2, 2, successors=0).label == "(3,2,2,8,0)"
    for text in ("3,2,2,0,16 fixed", "4,3,3,8,4"):
        assert LookaheadParams.parse(LookaheadParams.parse(text).label) == LookaheadParams.parse(text)
    for bad in ("3,2", "a,b,c", "1,2,3,4,5,6"):
        with pytest.raises(ValueError, match="three integers"):
            LookaheadParams.parse(bad)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 1}, "n must be >= 2"),
        ({"w": 0}, "w must be >= 1"),
        ({"g": -1}, "g must be >= 0"),
        ({"n": 2.5}, "n must be an integer"),
        ({"w": True}, "w must be an integer"),
        ({"pool_from_prompt": "yes"}, "pool_from_prompt must be a bool"),
        ({"lookup": -1}, "lookup must be >= 0"),
        ({"lookup_match": 0}, "lookup_match must be >= 1"),
        ({"successors": -1}, "successors must be >= 0"),
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

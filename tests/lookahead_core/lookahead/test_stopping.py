import pytest

from lookahead_core.lookahead.stopping import StopCondition


def test_eos_inside_a_block_cuts_after_it():
    stop = StopCondition.build(10, eos_token_id=3)
    assert stop.clip([1, 3, 4, 5], produced=0) == ([1, 3], "eos")


def test_stop_token_and_eos_list():
    stop = StopCondition.build(10, eos_token_id=[8, 9], stop_token_ids=[4])
    assert stop.clip([1, 4, 9], produced=0) == ([1, 4], "stop")
    assert stop.clip([1, 9, 4], produced=0) == ([1, 9], "eos")


def test_length_limit_inside_a_block():
    stop = StopCondition.build(5, eos_token_id=None)
    assert stop.clip([1, 2, 3], produced=3) == ([1, 2], "length")
    assert stop.clip([1, 2], produced=3) == ([1, 2], "length")
    assert stop.clip([1], produced=3) == ([1], None)


def test_eos_beyond_the_length_limit_is_not_reported():
    stop = StopCondition.build(2, eos_token_id=7)
    assert stop.clip([1, 2, 7], produced=0) == ([1, 2], "length")


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, None])
def test_invalid_max_new_tokens(bad):
    with pytest.raises(ValueError, match="max_new_tokens"):
        StopCondition.build(bad, eos_token_id=None)

import pytest

from lookahead_core.lookahead.suffix_index import SuffixIndex


def test_proposes_what_followed_the_last_earlier_match():
    text = [1, 2, 3, 4, 5, 9, 1, 2]
    idx = SuffixIndex(2)
    idx.extend(text)
    assert idx.propose(text, 3) == (3, 4, 5)
    assert idx.propose(text, 10) == (3, 4, 5, 9, 1, 2)


def test_most_recent_occurrence_wins():
    text = [1, 2, 3, 1, 2, 7, 1, 2]
    idx = SuffixIndex(2)
    idx.extend(text)
    assert idx.propose(text, 2) == (7, 1)


def test_no_match_and_the_suffix_itself_are_not_proposed():
    text = [1, 2, 3, 4]
    idx = SuffixIndex(2)
    idx.extend(text)
    assert idx.propose(text, 4) == ()
    assert idx.propose(text, 0) == ()


def test_extend_indexes_only_new_tokens_and_sees_them():
    text = [1, 2]
    idx = SuffixIndex(2)
    idx.extend(text)
    text += [3, 1, 2]
    assert idx.propose(text, 4) == ()  # (1, 2) -> 3 is not in the table until extended
    idx.extend(text)
    assert idx.propose(text, 4) == (3, 1, 2)


def test_match_length_must_be_positive():
    with pytest.raises(ValueError, match="suffix match"):
        SuffixIndex(0)

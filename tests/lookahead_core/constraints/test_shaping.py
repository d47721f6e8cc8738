"""A request's logits shaped by its options and grammar, and its state rolled back exactly."""
import pytest
import torch

from lookahead_core.constraints.grammar import Grammars, GrammarSpec, grammar_tokenizer
from lookahead_core.constraints.logit_rules import LogitRules
from lookahead_core.constraints.shaping import RowShaper
from tests.lookahead_core.helpers import char_tokenizer

V = 16


def test_penalties_bias_and_min_tokens_in_vllms_order():
    rules = LogitRules(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
                       logit_bias={3: 1.0, 4: -2.0}, min_tokens=2)
    shaper = RowShaper(rules, None, prompt=[3, 5], end_ids=[0], vocab_size=V)
    row = torch.linspace(-2, 2, V)
    z = shaper.shape(row)
    expect = row.clone()
    expect[0] = -torch.inf
    expect[3] += 1.0
    expect[4] -= 2.0
    for t in (3, 5):  # the prompt's tokens: repetition only (presence and frequency count new tokens)
        expect[t] = expect[t] / 2 if expect[t] > 0 else expect[t] * 2
    assert torch.equal(z, expect)
    shaper.advance(7)
    shaper.advance(7)
    z = shaper.shape(row)
    assert z[0] == row[0]  # two new tokens: the end is free again (and never seen: no penalty)
    r7 = row[7] / 2 if row[7] > 0 else row[7] * 2
    assert torch.isclose(z[7], r7 - 0.5 - 2 * 0.25)


def test_rollback_restores_every_count_and_the_grammar():
    rules = LogitRules(repetition_penalty=1.5, frequency_penalty=1.0, min_tokens=3)
    tok = char_tokenizer()
    grammar = Grammars(grammar_tokenizer(tok, 128), 128).matcher(GrammarSpec("regex", "[a-c]+"))
    shaper = RowShaper(rules, grammar, prompt=[ord("a")], end_ids=[1], vocab_size=128)
    row = torch.randn(128)
    shaper.advance(ord("b"))
    before = shaper.shape(row)
    for c in "cab":
        shaper.advance(ord(c))
    assert not torch.equal(shaper.shape(row), before)
    shaper.rollback(3)
    assert torch.equal(shaper.shape(row), before) and shaper.produced == 1


def test_min_tokens_yields_to_a_grammar_that_allows_only_the_end():
    tok = char_tokenizer()
    grammar = Grammars(grammar_tokenizer(tok, 128), 128).matcher(GrammarSpec("regex", "a"))
    shaper = RowShaper(LogitRules(min_tokens=5), grammar, prompt=[2], end_ids=[1], vocab_size=128)
    shaper.advance(ord("a"))
    z = shaper.shape(torch.zeros(128))
    assert torch.isfinite(z).nonzero().flatten().tolist() == [1]


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logit_bias={"a": 1}), "logit_bias"),
    (dict(logit_bias={5: 101}), r"logit_bias\[5\]"), (dict(min_tokens=-1), "min_tokens"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
])
def test_out_of_range_options_are_refused_naming_the_option(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LogitRules(**kwargs)


def test_neutral_options_are_inactive():
    assert not LogitRules().active and LogitRules(min_tokens=1).active and LogitRules(logit_bias={2: 0.5}).max_token == 2


def test_greedy_under_a_grammar_takes_the_shaped_rows_argmax_with_or_without_the_shortcut():
    tok = char_tokenizer()
    grammar = Grammars(grammar_tokenizer(tok, 128), 128).matcher(GrammarSpec("regex", "[a-m]+"))
    shaper = RowShaper(None, grammar, prompt=[2], end_ids=[1], vocab_size=128)
    gen = torch.Generator().manual_seed(0)
    for i in range(40):
        row = torch.randn(128, generator=gen)
        row[1] = -10.0  # never the end: all 40 rows are taken
        if i % 2:
            row[ord("c")] = 10.0  # the row's own argmax is one the grammar takes
        token = shaper.argmax(row)
        assert token == int(shaper.shape(row).argmax()) and ord("a") <= token <= ord("m")
        shaper.advance(token)
    assert shaper.produced == 40

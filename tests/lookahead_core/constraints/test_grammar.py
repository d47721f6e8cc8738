"""Grammar specs checked against a tokenizer, and a request's matcher: masks, forced runs, rollback."""
import pytest
import torch

from lookahead_core.constraints.grammar import Grammars, GrammarSpec, grammar_tokenizer
from tests.lookahead_core.helpers import char_tokenizer

VOCAB = 128


@pytest.fixture(scope="module")
def grammars():
    return Grammars(grammar_tokenizer(char_tokenizer(), VOCAB), VOCAB)


def text(tokens):
    return "".join(chr(t) for t in tokens)


@pytest.mark.parametrize(("spec", "message"), [
    (GrammarSpec("json", '{"type": "objectx"}'), "objectx"),
    (GrammarSpec("json", "{not json"), "json"),
    (GrammarSpec("regex", "[a-"), "unclosed character class"),
    (GrammarSpec("grammar", "start: foo\nfoo: bar"), "bar"),
])
def test_a_grammar_llguidance_cannot_build_is_refused_naming_why(grammars, spec, message):
    with pytest.raises(ValueError, match=message):
        spec.check(grammars.tokenizer)


@pytest.mark.parametrize(("kind", "source"), [("regex", " "), ("kindx", "a")])
def test_an_empty_source_or_unknown_kind_is_refused(kind, source):
    with pytest.raises(ValueError):
        GrammarSpec(kind, source)
    with pytest.raises(ValueError, match="non-empty list"):
        GrammarSpec.choice([])


def test_json_follows_one_layout_and_its_fixed_text_is_forced(grammars):
    schema = {"type": "object", "required": ["name", "n"], "additionalProperties": False,
              "properties": {"name": {"enum": ["ab", "cd"]}, "n": {"type": "integer"}}}
    state = grammars.matcher(GrammarSpec.json_schema(schema))
    assert text(state.forced_run(32)) == '{"name": "'
    for c in '{"name": "cd':
        state.advance(ord(c))
    assert text(state.forced_run(32)) == '", "n": '
    assert text(state.forced_run(3)) == '", '
    assert state.valid_prefix([ord(c) for c in '", "n":  1']) == 8  # one space after the colon, no more
    allowed = state.allowed()
    assert allowed.dtype == torch.bool and allowed.shape == (VOCAB,) and allowed.nonzero().flatten().tolist() == [ord('"')]
    for c in '", "n": 12}':
        state.advance(ord(c))
    assert state.done and state.allowed().nonzero().flatten().tolist() == [1]  # only the end


def test_rollback_returns_the_matcher_to_where_it_was_and_matchers_do_not_share_state(grammars):
    spec = GrammarSpec("regex", "(ab|cd)+!")
    a, b = grammars.matcher(spec), grammars.matcher(spec)
    for c in "abcd":
        a.advance(ord(c))
    before = a.allowed().clone()
    a.advance(ord("a"))
    a.rollback(1)
    assert torch.equal(a.allowed(), before)
    assert b.allowed().nonzero().flatten().tolist() == [ord("a"), ord("c")]
    with pytest.raises(RuntimeError, match="refused"):
        b.advance(ord("z"))


def test_a_row_masked_keeps_only_what_the_grammar_takes(grammars):
    state = grammars.matcher(GrammarSpec.choice(["yes", "no"]))
    row = torch.randn(VOCAB)
    masked = state.mask_(row.clone())
    assert torch.isfinite(masked).nonzero().flatten().tolist() == [ord("n"), ord("y")]
    assert masked[ord("y")] == row[ord("y")]

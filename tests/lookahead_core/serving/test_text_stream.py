"""TextStream against real tokenizers: byte-level BPE (characters split across tokens) and word level."""
import random

import pytest
from transformers import AutoTokenizer

from lookahead_core.serving import TextStream

TEXT = "héllo wörld 😀 naïve café 世界 🎉🎉 日本語 ok\n"


def pieces(ids, seed):
    """ids cut into random steps of 1-4 tokens, as engine steps accept them."""
    rng, out, i = random.Random(seed), [], 0
    while i < len(ids):
        k = rng.randint(1, 4)
        out.append(ids[i : i + k])
        i += k
    return out


def run(tok, ids, stops=(), seed=0):
    stream, deltas, hit = TextStream(tok, stops), [], False
    for step in pieces(ids, seed):
        delta, hit = stream.push(step)
        deltas.append(delta)
        if hit:
            break
    deltas.append(stream.flush())
    assert "".join(deltas) == stream.text
    return deltas, hit


def test_multibyte_characters_are_split_across_tokens(byte_bpe):
    ids = byte_bpe(TEXT)["input_ids"]
    # precondition: some tokens hold only part of a character
    assert any("\ufffd" in byte_bpe.decode([i]) for i in ids)
    assert len(ids) > len(TEXT.encode()) // 2


@pytest.mark.parametrize("seed", range(5))
def test_deltas_concatenate_to_one_decode(byte_bpe, seed):
    eos = byte_bpe.eos_token_id
    ids = byte_bpe(TEXT)["input_ids"] + [eos] + byte_bpe(" end")["input_ids"]
    deltas, hit = run(byte_bpe, ids, seed=seed)
    assert not hit
    assert "".join(deltas) == byte_bpe.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)  # half characters are never emitted


def test_one_token_at_a_time_emits_each_character_once_complete(byte_bpe):
    ids = byte_bpe("😀")["input_ids"]
    assert len(ids) == 4
    stream = TextStream(byte_bpe)
    assert [stream.push([i]) for i in ids] == [("", False)] * 3 + [("😀", False)]


def test_word_level_tokenizer_joins_as_one_decode(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("def f(x): return x\n")["input_ids"] + [1] + tok("ok")["input_ids"]
    for seed in range(3):
        deltas, _ = run(tok, ids, seed=seed)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("stop", ["😀", "wörld", "ok\n", "d 😀 n", "世"])
def test_stop_string_ends_the_text_before_it(byte_bpe, stop, seed):
    ids = byte_bpe(TEXT)["input_ids"]
    deltas, hit = run(byte_bpe, ids, stops=[stop, "never there"], seed=seed)
    assert hit and "".join(deltas) == TEXT[: TEXT.index(stop)]


def test_text_that_may_begin_a_stop_string_is_held_until_settled(byte_bpe):
    stream = TextStream(byte_bpe, ["world!"])
    delta, hit = stream.push(byte_bpe("hello wor")["input_ids"])
    assert not hit and "hello wor".startswith(delta) and len(delta) <= len("hello wor") - len("world!") + 1
    delta2, hit = stream.push(byte_bpe("ld?")["input_ids"])
    assert not hit
    assert delta + delta2 + stream.flush() == "hello world?"


def test_an_incomplete_character_at_the_end_is_flushed_as_a_replacement(byte_bpe):
    ids = byte_bpe("a😀")["input_ids"][:-1]
    stream = TextStream(byte_bpe)
    assert stream.push(ids) == ("", False)  # held with the unfinished character of its step
    assert stream.flush() == byte_bpe.decode(ids) == stream.text == "a\ufffd"


def test_each_step_decodes_a_bounded_window(byte_bpe):
    """O(1) per step: the tokens decoded per push do not grow with the length of the output."""
    decoded = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            decoded.append(len(ids))
            return byte_bpe.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = byte_bpe(TEXT * 20)["input_ids"]
    stream = TextStream(Counting(), ["zz"])
    for i in ids:
        stream.push([i])
    assert stream.text + stream.flush() == TEXT * 20
    assert max(decoded) <= 8, max(decoded)


def test_a_stop_token_has_no_text_as_in_vllm(byte_bpe):
    stop = byte_bpe("#")["input_ids"][0]
    ids = byte_bpe("ab")["input_ids"] + [stop]
    stream = TextStream(byte_bpe, stop_ids=[stop])
    assert stream.push(ids) == ("ab", False)
    assert stream.flush() == "" and stream.text == "ab"


@pytest.mark.parametrize("steps", [1, 2, 3, 5])
@pytest.mark.parametrize("min_tokens, text", [
    (0, "ab"),  # the first "c." counts
    (3, "ab"),  # it ends in token 4 (".")
    (4, "abc.de"),  # it ends within the first 4 tokens: only the second counts, as vLLM checks no stop string before
    (7, "abc.de"),  # a match ending after the floor counts even where it starts before it
    (8, "abc.dec.f"),  # neither: the output runs on
])
def test_stop_strings_count_only_past_min_tokens(byte_bpe, min_tokens, text, steps):
    out = "abc.dec.f"
    ids = byte_bpe(out)["input_ids"]
    assert len(ids) == len(out)  # precondition: a token per character
    stream, deltas, hit = TextStream(byte_bpe, ["c."], min_tokens=min_tokens), [], False
    for i in range(0, len(ids), steps):
        delta, hit = stream.push(ids[i : i + steps])
        deltas.append(delta)
        if hit:
            kept = i + stream.kept  # tokens up to the stop string's last
            break
    deltas.append(stream.flush())
    assert "".join(deltas) == text
    if hit:
        assert kept == out.index("c.", 3 if min_tokens >= 4 else 0) + 2

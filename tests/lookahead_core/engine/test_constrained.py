"""Output under a grammar and under vLLM's logits options, through the engine: each verified row
shaped along its tree path, so every lookahead setting decodes what plain masked decoding decodes."""
import math
from collections import Counter

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from lookahead_core import LookaheadParams
from lookahead_core.constraints.grammar import Grammars, GrammarSpec, grammar_tokenizer
from lookahead_core.constraints.logit_rules import LogitRules
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.io import EngineRequest
from lookahead_core.lookahead.sampling import SamplingParams, warp_rows
from lookahead_core.lookahead.stopping import FinishReason, StopCondition
from lookahead_core.models.random_models import build_random_model
from tests.lookahead_core.helpers import NO_EOS, char_tokenizer, hf_greedy, random_prompts

VOCAB = 128
EOS = 1
MODES = ["off", "auto", LookaheadParams(4, 4, 4)]

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "size", "tags", "ok"],
          "properties": {"kind": {"enum": ["alpha", "beta", "gamma"]}, "size": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}}}
GRAMMARS = [GrammarSpec.json_schema(SCHEMA), GrammarSpec("regex", r"(ab|cd)+[0-9]{2,4}!"),
            GrammarSpec.choice(["north", "south", "east", "west"]), GrammarSpec("json_object")]


@pytest.fixture(scope="module")
def model():
    return build_random_model("llama", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def grammars():
    return Grammars(grammar_tokenizer(char_tokenizer(), VOCAB), VOCAB)


def masked_greedy(model, grammars, spec, prompt, max_new):
    """Plain decoding under the grammar: one full forward per token, the argmax of the allowed."""
    state, ids = grammars.matcher(spec), list(prompt)
    with torch.inference_mode():
        for _ in range(max_new):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.masked_fill(~state.allowed(), -torch.inf).argmax())
            ids.append(token)
            if token == EOS:
                break
            state.advance(token)
    return ids[len(prompt):]


def drain(engine, requests):
    out: dict = {r.request_id: [] for r in requests}
    finished: dict = {}
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.seq_id, []).extend(o.tokens)
            if o.stats is not None:
                finished[o.seq_id] = o
    return out, finished


def engine_for(model, grammars=None, **kw):
    cfg = dict(max_batch=8, max_seq_len=256, max_new_tokens=96, successor_topk=8)
    return Engine(model, EngineConfig(**{**cfg, **kw}), grammars=grammars)


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_greedy_under_a_grammar_is_masked_greedy_token_for_token_beside_free_requests(model, grammars, mode):
    prompts = random_prompts(6, VOCAB, seed=3)
    refs = {f"g{i}": masked_greedy(model, grammars, spec, prompts[i], 80) for i, spec in enumerate(GRAMMARS)}
    free = {f"f{i}": hf_greedy(model, prompts[4 + i], 40, **NO_EOS) for i in range(2)}
    requests = [EngineRequest(f"g{i}", tuple(prompts[i]), StopCondition.build(80, EOS), mode, grammar=spec)
                for i, spec in enumerate(GRAMMARS)]
    requests += [EngineRequest(f"f{i}", tuple(prompts[4 + i]), StopCondition.build(40, None), mode) for i in range(2)]
    engine = engine_for(model, grammars, row_price=0.0)  # rows cost nothing: "auto" takes every row offered
    out, finished = drain(engine, requests)
    assert out == {**refs, **free}
    ended = [k for k in refs if refs[k][-1] == EOS]
    assert ended and all(finished[k].finish_reason is FinishReason.EOS for k in ended)
    if mode != "off":  # the grammar's forced text was proposed and accepted in the steps
        stats = [finished[k].stats for k in refs]
        assert sum(s.accepted_from.get("grammar", 0) for s in stats) > 0
        assert sum(s.new_tokens for s in stats) > sum(s.steps for s in stats)


def test_a_finished_grammar_ends_the_request_and_a_refused_candidate_is_never_proposed(model, grammars):
    spec = GrammarSpec.choice(["north", "south"])
    engine = engine_for(model, grammars)
    prompt = [ord(c) for c in "go no"] * 4  # prompt lookup proposes "no..." runs the grammar partly refuses
    engine.add_request(EngineRequest("r", tuple(prompt), StopCondition.build(40, EOS), LookaheadParams(3, 2, 2),
                                     grammar=spec))
    seq = engine._seqs["r"]
    proposed = []
    original = seq.drafter.draft

    def spy(tokens, price=0.0, grammar=None):
        draft = original(tokens, price, grammar)
        proposed.append((len(tokens), draft.tree.candidates))
        return draft

    seq.drafter.draft = spy
    out, finished = drain(engine, [])
    text = "".join(chr(t) for t in seq.new_tokens[:-1])
    assert text in ("north", "south") and seq.new_tokens[-1] == EOS and seq.finish_reason is FinishReason.EOS
    for length, cands in proposed:  # every candidate continues the text so far within the grammar
        sofar = "".join(chr(t) for t in seq.tokens[len(prompt):length])
        for cand in cands:
            more = sofar + "".join(chr(t) if t != EOS else "" for t in cand)
            assert "north".startswith(more) or "south".startswith(more)


def test_a_grammar_needs_an_engine_with_its_tokenizer_and_logit_bias_the_vocabulary(model, grammars):
    request = EngineRequest("r", (5, 6), StopCondition.build(4, EOS), grammar=GRAMMARS[1])
    with pytest.raises(ValueError, match="no tokenizer for grammars"):
        engine_for(model).add_request(request)
    with pytest.raises(ValueError, match="beyond the vocabulary"):
        engine_for(model).add_request(EngineRequest("b", (5, 6), StopCondition.build(4, EOS),
                                                    rules=LogitRules(logit_bias={VOCAB: 1.0})))


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the new tokens, as a HF logits processor."""

    def __init__(self, prompt_len, presence, frequency):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        new = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, new, torch.ones_like(new, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


RULES = [
    (LogitRules(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
    (LogitRules(repetition_penalty=0.7), dict(repetition_penalty=0.7)),
    (LogitRules(logit_bias={7: 6.0, 40: -100.0, 41: 3.5}), dict(sequence_bias={(7,): 6.0, (40,): -100.0, (41,): 3.5})),
    (LogitRules(presence_penalty=1.5, frequency_penalty=0.8), "openai"),
    (LogitRules(min_tokens=12), dict(min_new_tokens=12)),
]


@pytest.mark.parametrize(("rules", "hf"), RULES, ids=["repetition", "repetition<1", "logit_bias", "presence+frequency", "min_tokens"])
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_each_option_matches_hf_logits_processors_greedy_in_float32(model, rules, hf, mode):
    prompts = random_prompts(3, VOCAB, seed=11)
    # with min_tokens, each prompt's end is a token its plain greedy text reaches early
    ends = [hf_greedy(model, p, 5, **NO_EOS)[4] if rules.min_tokens else None for p in prompts]
    refs = {}
    for i, (prompt, eos) in enumerate(zip(prompts, ends)):
        kwargs = dict(eos_token_id=eos) if eos is not None else dict(NO_EOS)
        if hf == "openai":
            kwargs["logits_processor"] = LogitsProcessorList([OpenAIPenalties(len(prompt), rules.presence_penalty,
                                                                              rules.frequency_penalty)])
        else:
            kwargs.update(hf)
        refs[f"r{i}"] = hf_greedy(model, prompt, 40, **kwargs)
    requests = [EngineRequest(f"r{i}", tuple(p), StopCondition.build(40, eos), mode, rules=rules)
                for i, (p, eos) in enumerate(zip(prompts, ends))]
    out, _ = drain(engine_for(model, row_price=0.0), requests)
    assert out == refs
    if rules.min_tokens:  # plain decoding ends at token 5; the floor held each end back past it
        assert all(len(v) > rules.min_tokens and eos not in v[: rules.min_tokens] for v, eos in zip(out.values(), ends))


def test_stop_token_ids_end_a_request_as_stop():
    model = build_random_model("llama", vocab_size=VOCAB)
    prompt = random_prompts(1, VOCAB, seed=5)[0]
    ref = hf_greedy(model, prompt, 30, **NO_EOS)
    stop = ref[6]
    engine = engine_for(model)
    out, finished = drain(engine, [EngineRequest("s", tuple(prompt), StopCondition.build(30, None, [stop]), "auto")])
    assert out["s"] == ref[: ref.index(stop) + 1] and finished["s"].finish_reason is FinishReason.STOP


def chi_square(observed: Counter, expected: dict, n: int) -> float:
    return sum((observed.get(k, 0) - n * p) ** 2 / (n * p) for k, p in expected.items())


@pytest.mark.parametrize("mode", ["off", LookaheadParams(3, 3, 3)], ids=str)
def test_sampling_under_a_grammar_keeps_the_masked_distribution(model, grammars, mode):
    """Two characters from [a-d] under the grammar, drawn by 600 seeds: the pairs' counts against
    p(x1) p(x2 | x1) of the masked, warped distribution (chi-square, 15 degrees of freedom)."""
    spec, prompt = GrammarSpec("regex", "[a-d][a-d]"), [ord(c) for c in "pick two: "]
    warp = SamplingParams(temperature=1.5)
    letters = [ord(c) for c in "abcd"]

    def masked(ids):
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        allowed = torch.full((VOCAB,), -torch.inf)
        allowed[letters] = 0
        return warp_rows((logits + allowed).unsqueeze(0), warp)[0]

    first = masked(prompt)
    expected = {(a, b): float(first[a]) * float(masked(prompt + [a])[b]) for a in letters for b in letters}
    n = 600
    engine = engine_for(model, grammars, max_batch=16)
    requests = [EngineRequest(f"s{i}", tuple(prompt), StopCondition.build(3, EOS), mode, grammar=spec,
                              sampling=SamplingParams(temperature=1.5, seed=i)) for i in range(n)]
    out: dict = {}
    pending = list(requests)
    while pending or engine.has_work():
        while pending and len(engine.scheduler.waiting) < 8:
            engine.add_request(pending.pop())
        for o in engine.step():
            out.setdefault(o.seq_id, []).extend(o.tokens)
    assert all(v[2] == EOS and v[0] in letters and v[1] in letters for v in out.values())
    stat = chi_square(Counter((v[0], v[1]) for v in out.values()), expected, n)
    assert stat < 37.7, stat  # p = 0.001 at 15 degrees of freedom
    assert math.isclose(sum(expected.values()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("mode", ["off", LookaheadParams(3, 2, 2)], ids=str)
def test_a_grammar_no_token_can_continue_ends_its_request_and_the_batch_goes_on(model, grammars, mode):
    """"aÍ": after "a" the grammar needs a character no token writes; that request ends with its end
    token, its neighbour decodes as alone."""
    prompt = random_prompts(2, VOCAB, seed=8)
    free = hf_greedy(model, prompt[1], 20, **NO_EOS)
    out, finished = drain(engine_for(model, grammars), [
        EngineRequest("dead", tuple(prompt[0]), StopCondition.build(20, EOS), mode, grammar=GrammarSpec("regex", "aÍ")),
        EngineRequest("free", tuple(prompt[1]), StopCondition.build(20, None), mode)])
    assert out == {"dead": [ord("a"), EOS], "free": free}
    assert finished["dead"].finish_reason is FinishReason.EOS
    with pytest.raises(ValueError, match="needs an end token"):
        engine_for(model, grammars).add_request(EngineRequest("x", (5,), StopCondition.build(4, None), grammar=GRAMMARS[1]))

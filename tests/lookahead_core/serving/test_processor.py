"""RequestProcessor with a real AsyncEngine over the tiny fixture model, without Ray."""
import asyncio
import copy
import dataclasses
import json
import pickle
import re

import pytest
from tokenizers import decoders
from transformers import AutoModelForCausalLM, AutoTokenizer

from lookahead_core.constraints.grammar import Grammars, GrammarSpec, grammar_tokenizer
from lookahead_core.constraints.logit_rules import LogitRules
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.host.async_engine import AsyncEngine
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams
from lookahead_core.serving import Completion, Delta, RequestError, RequestLimits, RequestProcessor, ServeRequest
from lookahead_core.serving import processor as processor_module
from lookahead_core.serving.request import DEFAULT_MAX_NEW_TOKENS
from lookahead_core.serving.tools import AUTO_RULE, REQUIRED_RULE, ToolChoice, parse_tools, tool_grammar
from tests.fixtures import wait_until

from ...conftest import TINY_CHAT_TEMPLATE

LONG = 1000


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = TINY_CHAT_TEMPLATE
    return model, tok


@pytest.fixture(scope="module")
def engine(tiny):
    eng = AsyncEngine(Engine(tiny[0], EngineConfig(max_batch=4, max_seq_len=1024, max_new_tokens=LONG, prefill_chunk=32)))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def one_slot(tiny):
    """One slot and one waiting place: a long request makes the next one wait, the one after is refused."""
    eng = AsyncEngine(Engine(tiny[0], EngineConfig(max_batch=1, max_seq_len=1024, max_new_tokens=LONG, max_waiting=1)))
    yield eng
    eng.shutdown()


class Recording(Engine):
    """An engine that keeps each request's stats as its last output carries them off the engine thread."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.final: dict = {}

    def step(self):
        outputs = super().step()
        self.final.update((out.seq_id, out.stats) for out in outputs if out.finish_reason is not None)
        return outputs


class PublicOnly:
    """An AsyncEngine as a caller may use it: its limits, resolve, generate and finish, never its Engine."""

    def __init__(self, front: AsyncEngine) -> None:
        self._front = front

    def __getattr__(self, name):
        assert name in ("limits", "resolve", "generate", "finish"), f"the processor reached AsyncEngine.{name}"
        return getattr(self._front, name)


@pytest.fixture(scope="module")
def recording(tiny):
    eng = AsyncEngine(Recording(tiny[0], EngineConfig(max_batch=4, max_seq_len=1024, max_new_tokens=LONG,
                                                      prefill_chunk=32)))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def proc(tiny):
    return RequestProcessor(tiny[1], eos_token_ids=[1], limits=RequestLimits(max_prompt_tokens=100, request_timeout_s=60),
                            model_name="tiny")


async def collect(proc, req, engine):
    return [item async for item in proc.run(req, engine)]


def run(proc, req, engine):
    """All items of a request, or the RequestError it raised."""
    try:
        return asyncio.run(collect(proc, req, engine))
    except RequestError as err:
        return err


def check_items(items, tok):
    *deltas, done = items
    assert isinstance(done, Completion) and all(isinstance(d, Delta) for d in deltas)
    assert tuple(t for d in deltas for t in d.token_ids) == done.token_ids
    assert "".join(d.text for d in deltas) == done.text
    assert sum(1 for d in deltas if d.token_ids) == done.lookahead.steps
    assert done.usage.completion_tokens == len(done.token_ids)
    return done


def test_outputs_are_exact_with_any_lookahead_and_text_is_one_decode(proc, engine, tiny):
    tok = tiny[1]
    results = [check_items(run(proc, ServeRequest(prompt="def add(a, b):", max_new_tokens=24, lookahead=la), engine), tok)
               for la in ("off", LookaheadParams(4, 3, 3), LookaheadParams(2, 1, 1))]
    assert results[0].token_ids == results[1].token_ids == results[2].token_ids
    off, fixed = results[0], results[1]
    assert off.lookahead.mode == "off" and off.lookahead.n is None
    assert (fixed.lookahead.mode, fixed.lookahead.n, fixed.lookahead.w, fixed.lookahead.g) == ("fixed", 4, 3, 3)
    assert fixed.text == tok.decode(list(fixed.token_ids), skip_special_tokens=True)
    assert fixed.usage.prompt_tokens == len("def add(a, b):") and fixed.finish_reason in ("length", "eos")
    assert fixed.timings.total_ms >= fixed.timings.ttft_ms > 0
    ids = run(proc, ServeRequest(input_ids=tok("def add(a, b):")["input_ids"], max_new_tokens=24), engine)
    assert check_items(ids, tok).token_ids == off.token_ids


def test_concurrent_requests(proc, engine, tiny):
    reqs = [ServeRequest(prompt=p, max_new_tokens=16, lookahead=la)
            for p, la in [("class A:", "off"), ("for i in", LookaheadParams(5, 4, 4)), ("while", "auto")]]

    async def main():
        return await asyncio.gather(*(collect(proc, r, engine) for r in reqs))

    together = asyncio.run(main())
    for req, items in zip(reqs, together):
        assert check_items(items, tiny[1]).token_ids == check_items(run(proc, req, engine), tiny[1]).token_ids


def test_stop_string_cuts_the_text_and_ends_the_request(proc, engine, tiny):
    full = run(proc, ServeRequest(prompt="abc", max_new_tokens=24, lookahead="off"), engine)[-1]
    assert len(full.text) >= 4
    stop = full.text[2:4]
    eng = engine.engine
    aborted, written = eng.aborted, eng.knowledge.history.written
    cut = run(proc, ServeRequest(prompt="abc", max_new_tokens=24, stop=(stop,)), engine)[-1]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    # the engine ends it as a finish, not an abort: the text up to the stop becomes history
    assert wait_until(lambda: eng.knowledge.history.written > written and engine.queue_depth() == (0, 0), 5)
    assert eng.aborted == aborted
    added = eng.knowledge.history.ring[written : eng.knowledge.history.written].tolist()
    # the text up to the stop (more where the engine had ended the request itself before it heard)
    text = [*tiny[1]("abc")["input_ids"], *cut.token_ids]
    assert added[: len(text)] == text and added[-1] == -1  # -1: the gap after a text


def test_eos_and_ignore_eos(proc, engine):
    early = run(proc, ServeRequest(prompt="K", max_new_tokens=20), engine)[-1]
    assert early.finish_reason == "eos" and early.usage.completion_tokens < 20  # precondition of the fixture model
    on = run(proc, ServeRequest(prompt="K", max_new_tokens=20, ignore_eos=True), engine)[-1]
    assert on.finish_reason == "length" and on.usage.completion_tokens == 20


def test_seeded_sampling_reproduces(proc, engine):
    req = ServeRequest(prompt="def h(y):", max_new_tokens=16, sampling=SamplingParams(0.9, top_k=20, seed=11),
                       lookahead=LookaheadParams(3, 2, 3))
    assert run(proc, req, engine)[-1].token_ids == run(proc, req, engine)[-1].token_ids


def test_chat_template_renders_messages(proc, engine, tiny):
    msgs = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"})
    rendered = "<system>be brief\n<user>hi there\n<assistant>"
    assert proc.tokenize(ServeRequest(messages=msgs)) == tiny[1](rendered)["input_ids"]
    chat = run(proc, ServeRequest(messages=msgs, max_new_tokens=8), engine)[-1]
    plain = run(proc, ServeRequest(prompt=rendered, max_new_tokens=8), engine)[-1]
    assert chat.token_ids == plain.token_ids and chat.usage.prompt_tokens == len(rendered)


def test_chat_without_a_template_or_refused_by_it_is_a_400(tiny):
    tok = copy.deepcopy(tiny[1])
    tok.chat_template = None
    req = ServeRequest(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(RequestError, match="model 'tiny' has no chat template") as err:
        RequestProcessor(tok, model_name="tiny").tokenize(req)
    assert err.value.status == 400
    tok.chat_template = "{{ raise_exception('only one turn, please') }}"
    with pytest.raises(RequestError, match="refused these messages: only one turn") as err:
        RequestProcessor(tok).tokenize(req)
    assert err.value.status == 400


@pytest.mark.parametrize("req, status, message", [
    (ServeRequest(prompt="x" * 150), 400, "the prompt has 150 tokens; this server accepts at most 100"),
    (ServeRequest(prompt="x", stop=("s",) * 17), 400, "`stop` takes at most 16"),
    (ServeRequest(prompt="x", stop=("s" * 300,)), 400, "at most 256 characters"),
    (ServeRequest(prompt="x", max_new_tokens=LONG + 1), 400, f"exceeds this engine's limit of {LONG}"),
    (ServeRequest(prompt="x", lookahead=LookaheadParams(99, 2, 2)), 400, "n=99 exceeds"),
    (ServeRequest(input_ids=[1, 5000], max_new_tokens=4), 400, "vocabulary"),
])
def test_refusals_are_request_errors(proc, engine, req, status, message):
    err = run(proc, req, engine)
    assert isinstance(err, RequestError) and err.status == status and message in err.message, err
    assert engine.queue_depth() == (0, 0)


def test_a_prompt_far_beyond_the_limit_is_refused_by_its_size_before_it_is_tokenized(proc, engine, tiny, monkeypatch):
    calls = []
    monkeypatch.setattr(type(tiny[1]), "__call__", lambda *a, **k: calls.append(a) or {"input_ids": [2]})
    for req in (ServeRequest(prompt="x" * (64 * 100 + 1)),
                ServeRequest(messages=[{"role": "user", "content": "y" * 4000}, {"role": "user", "content": "z" * 3000}])):
        err = run(proc, req, engine)
        assert isinstance(err, RequestError) and err.status == 400 and "characters" in err.message, err
        assert "at most 100 prompt tokens" in err.message
    assert calls == []  # never tokenized
    assert isinstance(run(proc, ServeRequest(prompt="x" * 6400, max_new_tokens=1), engine)[-1], Completion)
    assert len(calls) == 1  # within the size bound: tokenized (and here 1 token)


def long_req(**kw):
    return ServeRequest(prompt="0123", max_new_tokens=LONG, lookahead="off", ignore_eos=True, **kw)


def test_timeouts_partial_408_and_504(proc, one_slot, tiny):
    part = run(proc, long_req(timeout_s=0.2), one_slot)
    assert isinstance(part, list) and part[-1].finish_reason == "timeout"
    assert 0 < part[-1].usage.completion_tokens < LONG
    # the engine's count comes after the deadline, which does not wait for it: no figures claimed
    assert (part[-1].lookahead.steps, part[-1].lookahead.compression, part[-1].lookahead.steps_by_kind) == (0, None, {})
    capped = RequestProcessor(tiny[1], limits=RequestLimits(request_timeout_s=0.1))

    async def main():
        busy = proc.run(long_req(), one_slot)
        await busy.__anext__()  # the only slot is taken
        try:
            errors = []
            for p, req in ((proc, long_req(timeout_s=0.1)), (capped, long_req()), (capped, long_req(timeout_s=5))):
                try:
                    await collect(p, req, one_slot)
                except RequestError as err:
                    errors.append(err)
            return errors
        finally:
            await busy.aclose()

    own, server, capped_own = asyncio.run(main())
    assert own.status == 408 and "(its timeout_s) before its first token" in own.message
    assert server.status == 504 and "the server's request_timeout_s" in server.message
    assert capped_own.status == 504  # the server's ceiling came first


def test_overload_is_a_503_and_abort_stays_abort(proc, one_slot):
    async def main():
        first = proc.run(long_req(request_id="first"), one_slot)
        await first.__anext__()
        second = proc.run(long_req(), one_slot)
        waiting = asyncio.ensure_future(second.__anext__())  # takes the one waiting place
        while one_slot.queue_depth() != (1, 1):  # until the engine thread has queued it
            await asyncio.sleep(0)
        with pytest.raises(RequestError) as err:
            await collect(proc, long_req(), one_slot)
        one_slot.abort("first")
        rest = [item async for item in first]
        await waiting
        await second.aclose()
        return err.value, rest

    err, rest = asyncio.run(main())
    assert err.status == 503 and "overloaded" in err.message
    assert isinstance(rest[-1], Completion) and rest[-1].finish_reason == "abort"
    # the engine's count of an aborted request: every step it streamed (the first item was read above)
    assert rest[-1].lookahead.steps == 1 + sum(1 for d in rest[:-1] if d.token_ids)


class FailsOnce(Engine):
    failed = False

    def step(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("boom")
        return super().step()


def test_failed_step_is_a_500_and_the_engine_serves_on(proc, tiny):
    eng = AsyncEngine(FailsOnce(tiny[0], EngineConfig(max_batch=2, max_seq_len=256, max_new_tokens=16)))
    try:
        err = run(proc, ServeRequest(prompt="x", max_new_tokens=4), eng)
        assert isinstance(err, RequestError) and err.status == 500 and "boom" in err.message
        assert run(proc, ServeRequest(prompt="x", max_new_tokens=4), eng)[-1].usage.completion_tokens >= 1
    finally:
        eng.shutdown()


def test_a_stopped_engine_is_a_503_to_retry_elsewhere(proc, tiny):
    """The engine's thread gone (its process killed, in a replica): the replica is being replaced,
    so the request is retryable, not the server's 500."""
    eng = AsyncEngine(Engine(tiny[0], EngineConfig(max_batch=2, max_seq_len=256, max_new_tokens=16)))
    eng.shutdown()
    assert wait_until(lambda: not eng.host.alive, 10)
    err = run(proc, ServeRequest(prompt="x", max_new_tokens=4), eng)
    assert isinstance(err, RequestError) and (err.status, err.code) == (503, "replica_failed")
    assert "the engine thread stopped" in err.message


def test_auto_reports_the_engines_setting_and_what_the_request_ran(proc, engine):
    done = run(proc, ServeRequest(prompt="def f(x):", max_new_tokens=12, ignore_eos=True), engine)[-1]
    cfg = engine.engine.config.lookahead
    assert (done.lookahead.mode, done.lookahead.n, done.lookahead.w, done.lookahead.g) == ("auto", cfg.n, cfg.w, cfg.g)
    kinds = done.lookahead.steps_by_kind
    assert sum(kinds.values()) == done.lookahead.steps and set(kinds) <= {"plain", "verify", "full"}
    assert done.lookahead.mean_width >= 1 and done.lookahead.compression == round(12 / done.lookahead.steps, 3)
    off = run(proc, ServeRequest(prompt="def f(x):", max_new_tokens=12, ignore_eos=True, lookahead="off"), engine)[-1]
    assert done.token_ids == off.token_ids and off.lookahead.steps_by_kind == {"plain": 12}
    assert off.lookahead.sources == {}


def test_the_summary_reports_each_candidate_sources_rows(proc, tiny):
    """Per source, the tree rows it put in the request's steps and how many of them were accepted:
    the accepted rows are the tokens beyond one per step. Every step but the first (the prefill's
    token) is wide. Rows are priced at 0 (every candidate row runs): measured on a tiny model,
    the price is timing noise and may trim every row."""
    params = LookaheadParams(3, 2, 2, adapt=False)
    engine = AsyncEngine(Engine(tiny[0], EngineConfig(max_batch=1, max_seq_len=1024, max_new_tokens=LONG, row_price=0.0)))
    try:
        done = run(proc, ServeRequest(prompt="def f(x): return x\ndef f(x):", max_new_tokens=16, ignore_eos=True,
                                      lookahead=params), engine)[-1]
    finally:
        engine.shutdown()
    sources = done.lookahead.sources
    assert sources and set(sources) <= {"lookup", "pool", "shared", "successors", "history"}
    assert all(0 <= c["accepted"] <= c["proposed"] for c in sources.values())
    wide = sum(n for kind, n in done.lookahead.steps_by_kind.items() if kind != "plain")
    assert sum(c["accepted"] for c in sources.values()) == 16 - done.lookahead.steps
    assert done.lookahead.steps_by_kind["plain"] == 1 and wide == done.lookahead.steps - 1


def test_a_stop_string_completed_mid_step_cuts_ids_usage_and_logprobs_as_off(proc, engine, tiny):
    """A lookahead step that accepts the tokens completing a stop string and more reports only
    the tokens up to the stop, as plain decoding does."""
    tok, wide = tiny[1], LookaheadParams(4, 3, 3, adapt=False)
    base = {"prompt": "def add(a, b):", "max_new_tokens": 48, "ignore_eos": True, "logprobs": 1}
    items = run(proc, ServeRequest(**base, lookahead=wide), engine)
    produced = []
    step = next((d for d in items[:-1] if len(d.token_ids) >= 2 or produced.extend(d.token_ids)), None)
    assert step is not None, "precondition: a step accepted 2 or more tokens"
    upto = [*produced, step.token_ids[0]]
    text = tok.decode(upto, skip_special_tokens=True)
    stop = next(text[-k:] for k in range(1, len(text) + 1) if text.find(text[-k:]) == len(text) - k)
    off, la = (run(proc, ServeRequest(**base, stop=(stop,), lookahead=mode), engine)[-1] for mode in ("off", wide))
    assert off.finish_reason == la.finish_reason == "stop" and off.text == la.text
    # the stop ends within the step's first token (or before it, for ids with no text of their own)
    assert la.token_ids == off.token_ids == tuple(upto[: len(la.token_ids)]) and len(la.token_ids) <= len(upto)
    assert la.usage == off.usage and la.usage.completion_tokens == len(la.token_ids)
    assert [lp.token_id for lp in la.logprobs] == [lp.token_id for lp in off.logprobs] == list(la.token_ids)
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(la.logprobs, off.logprobs))


def test_items_survive_pickling(proc, engine):
    items = run(proc, ServeRequest(prompt="abc", max_new_tokens=6), engine)
    assert pickle.loads(pickle.dumps(items)) == items
    err = RequestError(503, "busy", param="p", code="overloaded", type="server_error")
    back = pickle.loads(pickle.dumps(err))
    assert back == err and (back.status, back.message, back.param, back.code, back.type) == (503, "busy", "p", "overloaded", "server_error")


def test_echo_puts_the_prompt_first_with_its_logprobs(proc, engine):
    req = ServeRequest(prompt="abcd", max_new_tokens=4, logprobs=2, echo=True, ignore_eos=True)
    items = run(proc, req, engine)
    assert not isinstance(items, RequestError), items
    *deltas, done = items
    assert deltas[0].text == "abcd" and deltas[0].token_ids == ()
    assert done.text.startswith("abcd") and done.usage.prompt_tokens == 4 and done.usage.completion_tokens == 4
    assert [lp.token for lp in done.logprobs] == list("abcd") + [lp.token for lp in done.logprobs[4:]]
    assert done.logprobs[0].logprob is None and all(len(lp.top) == 2 for lp in done.logprobs[1:])
    assert tuple(lp.token_id for lp in done.logprobs[4:]) == done.token_ids
    streamed = [lp for d in deltas for lp in d.logprobs]
    assert tuple(streamed) == done.logprobs


def test_n_choices_are_interleaved_and_seeded_apart(proc, engine):
    req = ServeRequest(prompt="def f(", max_new_tokens=10, n=3, sampling=SamplingParams(1.0, seed=3), ignore_eos=True,
                       lookahead=LookaheadParams(3, 2, 2))
    items = run(proc, req, engine)
    done = {c.index: c for c in items if isinstance(c, Completion)}
    assert sorted(done) == [0, 1, 2]
    for i, c in done.items():
        assert tuple(t for d in items if isinstance(d, Delta) and d.index == i for t in d.token_ids) == c.token_ids
    alone = run(proc, ServeRequest(prompt="def f(", max_new_tokens=10, sampling=SamplingParams(1.0, seed=4),
                                   ignore_eos=True), engine)[-1]
    assert done[1].token_ids == alone.token_ids  # choice i draws from seed + i
    assert len({c.token_ids for c in done.values()}) > 1


def test_a_failing_choice_fails_the_request(proc, engine):
    req = ServeRequest(input_ids=(5, 5000), max_new_tokens=4, n=2)
    err = run(proc, req, engine)
    assert isinstance(err, RequestError) and err.status == 400 and "vocabulary" in err.message


@pytest.mark.parametrize(("asked", "limit", "context", "budget"),
                         [(None, 512, 1024, 128), (None, 64, 1024, 64), (None, 512, 100, 98), (300, 512, 1024, 300)])
def test_a_request_naming_no_budget_gets_128_tokens_or_what_the_engine_leaves(proc, asked, limit, context, budget):
    """128, or the engine's token limit, or the room its max_seq_len leaves after the prompt."""
    ereq = proc.engine_request(ServeRequest(prompt="x", max_new_tokens=asked), [5, 6], token_limit=limit,
                               max_seq_len=context)
    assert ereq.stop.max_new_tokens == budget


def test_a_prompt_near_the_context_end_naming_no_budget_gets_the_room_left(tiny, proc):
    """A prompt 40 tokens short of max_seq_len, no budget named: 40 tokens, not a 400 for 128."""
    eng = AsyncEngine(Engine(tiny[0], EngineConfig(max_batch=1, max_seq_len=100, max_new_tokens=512)))
    try:
        prompt = tuple(range(5, 65))
        done = run(proc, ServeRequest(input_ids=prompt, ignore_eos=True), eng)[-1]
        assert isinstance(done, Completion) and len(done.token_ids) == 40
        refused = run(proc, ServeRequest(input_ids=prompt, max_new_tokens=41), eng)
        assert isinstance(refused, RequestError) and refused.status == 400 and "100 tokens" in refused.message
    finally:
        eng.shutdown()


def assert_summary_is(done, stats):
    """The completion's summary is the engine's count, figure for figure."""
    assert stats is not None and stats.steps >= 1
    s = done.lookahead
    assert (s.steps, s.steps_by_kind) == (stats.steps, stats.steps_by_kind)
    assert (s.compression, s.mean_width) == (round(stats.compression, 3), round(stats.mean_width, 2))
    assert s.sources == {name: {"proposed": p, "accepted": stats.accepted_from.get(name, 0)}
                         for name, p in stats.proposed.items()}


@pytest.mark.parametrize(("name", "lookahead"), [("off", "off"), ("wide", LookaheadParams(4, 3, 3, adapt=False))])
def test_the_summary_is_the_engines_count_of_the_request_also_when_a_stop_string_cut_it(proc, recording, tiny, name,
                                                                                         lookahead):
    """One tally: the summary is the request's `SequenceStats`, including the tokens a stop string
    cut (the steps that accepted them ran). The processor reaches the engine only through the
    AsyncEngine's public surface."""
    front, final = PublicOnly(recording), recording.engine.final
    base = {"prompt": "def add(a, b):", "max_new_tokens": 48, "ignore_eos": True, "lookahead": lookahead}
    whole = run(proc, ServeRequest(**base, request_id=f"whole-{name}"), front)
    assert not isinstance(whole, RequestError), whole
    assert_summary_is(check_items(whole, tiny[1]), final[f"whole-{name}"])
    text = whole[-1].text
    stop = text[20:23]
    cut = run(proc, ServeRequest(**base, stop=(stop,), request_id=f"cut-{name}"), front)[-1]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]
    stats = final[f"cut-{name}"]
    assert_summary_is(cut, stats)
    if name == "wide":  # the step that completed the stop accepted more: a recount of the kept tokens differs
        assert stats.new_tokens > cut.usage.completion_tokens


class FailsAfterFinish(Engine):
    """The step after a caller ended a request raises: that request's count never comes."""

    ended = False

    def finish(self, *args, **kwargs):
        self.ended = True
        return super().finish(*args, **kwargs)

    def step(self):
        if self.ended:
            self.ended = False
            raise RuntimeError("boom")
        return super().step()


def test_a_stop_string_then_a_failed_step_is_the_cut_text_without_figures(proc, tiny):
    """The text was complete at the stop string: a step failing before the engine's count came
    leaves the completion standing, claiming no figures, rather than a 500 or a wait."""
    eng = AsyncEngine(FailsAfterFinish(tiny[0], EngineConfig(max_batch=1, max_seq_len=256, max_new_tokens=64)))
    base = {"prompt": "abc", "max_new_tokens": 48, "ignore_eos": True, "lookahead": "off"}
    try:
        text = run(proc, ServeRequest(**base), eng)[-1].text
        cut = run(proc, ServeRequest(**base, stop=(text[20:23],)), eng)
        assert isinstance(cut, list) and cut[-1].finish_reason == "stop", cut
        assert cut[-1].text == text[: text.index(text[20:23])] and cut[-1].usage.completion_tokens > 0
        summary = cut[-1].lookahead
        assert (summary.steps, summary.compression, summary.steps_by_kind, summary.mean_width) == (0, None, {}, None)
    finally:
        eng.shutdown()


def test_a_requests_total_work_is_bounded_by_max_request_tokens(tiny, engine):
    """n x (prompt + max_tokens) over `limits.max_request_tokens` is a 400 naming `n`, before any
    choice reaches the engine; at the limit the request runs, its choices one group."""
    proc = RequestProcessor(tiny[1], eos_token_ids=[1], limits=RequestLimits(max_request_tokens=3 * (4 + 8)),
                            model_name="tiny")
    prompt = (100, 101, 102, 32)
    err = run(proc, ServeRequest(input_ids=prompt, max_new_tokens=9, n=3), engine)
    assert isinstance(err, RequestError) and err.status == 400 and err.param == "n" and "39 tokens" in err.message
    assert engine.queue_depth() == (0, 0)
    items = run(proc, ServeRequest(input_ids=prompt, max_new_tokens=8, n=3, ignore_eos=True), engine)
    assert sorted(c.index for c in items if isinstance(c, Completion)) == [0, 1, 2]
    ereq = proc.engine_request(ServeRequest(input_ids=prompt, n=3), list(prompt), 8, 64, group="r")
    assert ereq.group == "r" and ereq.max_new_tokens == 8


def test_min_tokens_over_the_token_budget_is_a_400_naming_it(proc, engine):
    """min_tokens above max_tokens (given, or the default the prompt leaves) could never be met: a
    400 before the engine; equal to it, the request runs to exactly that many tokens."""
    prompt = (100, 101, 102, 32)
    err = run(proc, ServeRequest(input_ids=prompt, max_new_tokens=4, rules=LogitRules(min_tokens=5)), engine)
    assert isinstance(err, RequestError) and err.status == 400 and err.param == "min_tokens"
    assert "min_tokens=5" in err.message and "max_tokens (4)" in err.message
    err = run(proc, ServeRequest(input_ids=prompt, rules=LogitRules(min_tokens=DEFAULT_MAX_NEW_TOKENS + 1)), engine)
    assert isinstance(err, RequestError) and err.param == "min_tokens" and "default max_tokens" in err.message
    assert engine.queue_depth() == (0, 0)
    items = run(proc, ServeRequest(input_ids=prompt, max_new_tokens=5, rules=LogitRules(min_tokens=5)), engine)
    (done,) = [c for c in items if isinstance(c, Completion)]
    assert len(done.token_ids) == 5


def test_the_engine_request_carries_the_logits_options_grammar_and_stop_token_ids(proc):
    rules, grammar = LogitRules(frequency_penalty=1.0, min_tokens=3), GrammarSpec("regex", "[ab]+")
    ereq = proc.engine_request(ServeRequest(prompt="x", rules=rules, grammar=grammar, stop_token_ids=[5, 6]), [40], LONG, 1024)
    assert ereq.rules == rules and ereq.grammar == grammar
    assert ereq.stop.stop_ids == {5, 6} and ereq.stop.eos_ids == {1}
    plain = proc.engine_request(ServeRequest(prompt="x", rules=LogitRules(presence_penalty=0.0)), [40], LONG, 1024)
    assert plain.rules is None and plain.grammar is None and plain.stop.stop_ids == frozenset()  # the engine's fast path
    # ignore_eos leaves EOS out of the end tokens, not a stop token id that names it
    ignoring = proc.engine_request(ServeRequest(prompt="x", ignore_eos=True, stop_token_ids=[1]), [40], LONG, 1024)
    assert ignoring.stop.eos_ids == frozenset() and ignoring.stop.stop_ids == {1}


def test_a_stop_token_ends_the_choice_as_stop_kept_in_its_ids_not_in_its_text(proc, engine, tiny):
    tok, base = tiny[1], {"prompt": "def add(a, b):", "max_new_tokens": 24, "ignore_eos": True}
    full = run(proc, ServeRequest(**base, lookahead="off"), engine)[-1]
    k = next(i for i, t in enumerate(full.token_ids) if i >= 2 and t not in full.token_ids[:i])
    for lookahead in ("off", LookaheadParams(4, 3, 3, adapt=False)):
        items = run(proc, ServeRequest(**base, lookahead=lookahead, stop_token_ids=[full.token_ids[k]]), engine)
        done = check_items(items, tok)
        assert done.finish_reason == "stop" and done.token_ids == full.token_ids[: k + 1]
        assert done.text == tok.decode(list(full.token_ids[:k]), skip_special_tokens=True)
        assert done.usage.completion_tokens == k + 1


@pytest.mark.parametrize("req, param, message", [
    (ServeRequest(prompt="x", rules=LogitRules(logit_bias={127: 1.0})), "logit_bias", "names token 127, beyond the vocabulary"),
    (ServeRequest(prompt="x", stop_token_ids=[3, 5000]), "stop_token_ids", "names token 5000, beyond the vocabulary"),
])
def test_token_ids_beyond_the_vocabulary_are_400s_naming_the_field(proc, engine, req, param, message):
    err = run(proc, req, engine)
    assert isinstance(err, RequestError) and (err.status, err.param) == (400, param) and message in err.message, err
    assert engine.queue_depth() == (0, 0)


def test_a_tokenizer_llguidance_cannot_read_refuses_grammars_naming_the_field(tiny, engine, monkeypatch):
    def unreadable(tok, vocab_size):
        raise ValueError("can't determine decoder type")

    monkeypatch.setattr(processor_module, "grammar_tokenizer", unreadable)
    req = ServeRequest(prompt="x", grammar=GrammarSpec("regex", "a+"), grammar_field="response_format")
    err = run(RequestProcessor(tiny[1], model_name="tiny"), req, engine)
    assert isinstance(err, RequestError) and (err.status, err.param, err.code) == (400, "response_format", "unsupported_parameter")
    assert "`response_format` is not supported for model 'tiny'" in err.message and "decoder type" in err.message
    assert engine.queue_depth() == (0, 0)


def test_the_vocabulary_is_the_models_where_given(tiny):
    wide = RequestProcessor(tiny[1], vocab_size=200)
    wide.check_options(ServeRequest(prompt="x", rules=LogitRules(logit_bias={199: 1.0}), stop_token_ids=[150]))
    with pytest.raises(RequestError, match="names token 200"):
        wide.check_options(ServeRequest(prompt="x", stop_token_ids=[200]))


@pytest.fixture(scope="module")
def bpe_proc(byte_bpe):
    """A processor over a byte-level BPE, a tokenizer llguidance reads."""
    return RequestProcessor(byte_bpe, eos_token_ids=[byte_bpe.eos_token_id], model_name="bpe")


@pytest.mark.parametrize("grammar, message", [
    (GrammarSpec.json_schema({"type": "objectx"}), "Invalid type: objectx"),
    (GrammarSpec("json", "{not json"), "key must be a string"),
    (GrammarSpec("regex", "[a-"), "unclosed character class"),
    (GrammarSpec("grammar", "root ::= foo"), "Rule 'foo' not found"),
])
@pytest.mark.parametrize("field", ["response_format", "structured_outputs"])
def test_a_grammar_llguidance_refuses_is_a_400_naming_its_field_before_the_engine(bpe_proc, engine, grammar, message, field):
    err = run(bpe_proc, ServeRequest(prompt="x", grammar=grammar, grammar_field=field), engine)
    assert isinstance(err, RequestError) and (err.status, err.param) == (400, field), err
    assert err.message.startswith(f"`{field}`: ") and message in err.message, err.message
    assert engine.queue_depth() == (0, 0)


def test_grammars_are_checked_with_one_llguidance_tokenizer_built_on_the_first(byte_bpe, monkeypatch):
    built = []

    def counting(tok, vocab_size):
        built.append(vocab_size)
        return grammar_tokenizer(tok, vocab_size)

    monkeypatch.setattr(processor_module, "grammar_tokenizer", counting)
    fresh = RequestProcessor(byte_bpe, model_name="bpe")
    fresh.check_options(ServeRequest(prompt="x"))
    assert built == []  # none until a request has a grammar
    for grammar in (GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
                    GrammarSpec("json_object"), GrammarSpec.choice(["yes", "no"]), GrammarSpec("regex", "[0-9]{2,4}"),
                    GrammarSpec("grammar", 'root ::= "a" | "b"'), GrammarSpec("grammar", 'start: "a"+')):
        fresh.check_options(ServeRequest(prompt="x", grammar=grammar))
    assert built == [fresh.vocab_size]


@pytest.fixture(scope="module")
def grammar_engine(tiny):
    """An engine that follows grammars (llguidance's view of the tiny tokenizer: a word-level one, read token by token)."""
    vocab = tiny[0].config.vocab_size
    eng = AsyncEngine(Engine(tiny[0], EngineConfig(max_batch=4, max_seq_len=1024, max_new_tokens=LONG, prefill_chunk=32),
                             grammars=Grammars(grammar_tokenizer(tiny[1], vocab), vocab)))
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("grammar, pattern", [
    (GrammarSpec.choice(["yes", "no"]), "yes|no"),
    (GrammarSpec("regex", "[0-9]{3}-[a-z]{2}"), "[0-9]{3}-[a-z]{2}"),
])
def test_a_grammar_holds_the_output_with_any_lookahead(proc, grammar_engine, tiny, grammar, pattern):
    """From the request to the engine's shaped rows: the output matches and ends; lookahead changes nothing."""
    base = {"prompt": "def add(a, b):", "max_new_tokens": 40, "grammar": grammar, "grammar_field": "structured_outputs"}
    off, la = (check_items(run(proc, ServeRequest(**base, lookahead=mode), grammar_engine), tiny[1])
               for mode in ("off", LookaheadParams(4, 3, 3)))
    assert off.token_ids == la.token_ids and off.finish_reason == la.finish_reason == "eos"
    assert re.fullmatch(pattern, "".join(tiny[1].convert_ids_to_tokens(list(off.token_ids[:-1]))))


# ---- tools ------------------------------------------------------------------------------------------------------------

TOOLS = parse_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}])
ASK = ({"role": "user", "content": "Weather in Oslo?"},)
# a template that renders `tools` itself, as Qwen's, Llama 3's, Hermes' do
TOOL_TEMPLATE = "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}" + TINY_CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tools_proc(tiny):
    """A processor whose tokenizer writes text as the model wrote it (the tiny one puts a space between its tokens)."""
    tok = copy.deepcopy(tiny[1])
    tok.backend_tokenizer.decoder = decoders.Fuse()
    return RequestProcessor(tok, eos_token_ids=[1], limits=RequestLimits(max_prompt_tokens=800, request_timeout_s=60),
                            model_name="tiny")


def _text(proc, req) -> str:
    return "".join(proc.tokenizer.convert_ids_to_tokens(proc.tokenize(req)))


@pytest.mark.parametrize("choice", [ToolChoice("auto"), ToolChoice("required"), ToolChoice("function", "get_weather")])
def test_tools_reach_the_model_in_the_system_turn_or_the_templates_own_way(tools_proc, choice):
    req = ServeRequest(messages=ASK, tools=TOOLS, tool_choice=choice)
    text = _text(tools_proc, req)
    assert text.startswith("<system>You may call these tools") and text.endswith("<user>Weather in Oslo?\n<assistant>")
    assert json.dumps(TOOLS[0].openai()) in text and (AUTO_RULE in text) == (choice.mode == "auto")
    assert (REQUIRED_RULE in text) == (choice.mode == "required")
    assert _text(tools_proc, dataclasses.replace(req, tool_choice=ToolChoice("none"))) == "<user>Weather in Oslo?\n<assistant>"
    takes = copy.copy(tools_proc)
    takes.tokenizer = copy.deepcopy(tools_proc.tokenizer)
    takes.tokenizer.chat_template = TOOL_TEMPLATE
    text = _text(takes, req)
    assert text.startswith("[tool get_weather]") and "<tools>" not in text
    assert text.endswith("<user>Weather in Oslo?\n<assistant>") and (text.count("<system>") == choice.forced)  # its rule alone


def test_the_prompt_size_bound_counts_the_tools_and_calls(tools_proc, engine):
    small = copy.copy(tools_proc)
    small.limits = RequestLimits(max_prompt_tokens=2, request_timeout_s=60)  # 128 characters
    wordy = parse_tools([{"type": "function", "function": {"name": "f", "description": "d" * 100}}])
    for req in (ServeRequest(messages=ASK, tools=wordy, tool_choice=ToolChoice("auto")),
                ServeRequest(messages=({"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}" + " " * 100}}]},))):
        err = run(small, req, engine)
        assert isinstance(err, RequestError) and "characters" in err.message, err
    small.check_prompt_size(ServeRequest(messages=ASK, tools=wordy))  # "none" offers them not: not counted


def test_a_forced_choice_is_held_to_its_calls_and_each_of_n_choices_reads_its_own(tools_proc, grammar_engine):
    """From the request to the engine's grammar and back: the output is one call or more, read into tool_calls."""
    for choice in (ToolChoice("required"), ToolChoice("function", "get_weather")):
        req = ServeRequest(messages=ASK, tools=TOOLS, tool_choice=choice, max_new_tokens=200, n=2)
        assert tools_proc.engine_request(req, [40], LONG, 1024).grammar == tool_grammar(TOOLS, choice)
        items = run(tools_proc, req, grammar_engine)
        for i in range(2):
            *deltas, done = [item for item in items if item.index == i]
            assert done.finish_reason == "eos" and done.text == "" and done.tool_calls
            assert [c for d in deltas for c in d.tool_calls] == list(done.tool_calls)  # streamed as whole
            assert [c.name for c in done.tool_calls] == ["get_weather"] * len(done.tool_calls)
            assert all(isinstance(json.loads(c.arguments)["city"], str) for c in done.tool_calls)

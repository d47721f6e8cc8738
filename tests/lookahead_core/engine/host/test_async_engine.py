import asyncio
import threading
import time

import pytest

from lookahead_core import LookaheadParams
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.host.async_engine import AsyncEngine, EngineLimits
from lookahead_core.lookahead.stopping import FinishReason
from lookahead_core.models.random_models import build_random_model
from tests.fixtures import wait_until
from tests.lookahead_core.helpers import req, well_conditioned_cases


@pytest.fixture(scope="module")
def setup():
    model = build_random_model("llama")
    cases = well_conditioned_cases(model, 4, 512, seed=31, max_new_tokens=24)
    engine = AsyncEngine(Engine(model, EngineConfig(max_batch=4, prefill_chunk=16, max_new_tokens=512)))
    yield engine, cases
    engine.shutdown()


def test_concurrent_streams_equal_their_references(setup):
    engine, cases = setup
    params = [None, LookaheadParams(3, 4, 4), LookaheadParams(5, 7, 7), LookaheadParams(4, 5, 5)]

    async def one(i):
        out = []
        async for step in engine.generate(req(f"c{i}", cases[i][0], 24, params[i])):
            out += step.tokens
            last = step
        return out, last

    async def main():
        return await asyncio.gather(*(one(i) for i in range(4)))

    results = asyncio.run(main())
    for (tokens, last), (_, ref) in zip(results, cases):
        assert tokens == ref
        assert last.finish_reason == "length" and last.stats.new_tokens == 24


def test_closing_a_stream_frees_its_slot_within_one_step(setup):
    engine, cases = setup
    aborted = engine.engine.aborted

    async def main():
        stream = engine.generate(req("close", cases[0][0], 500))
        await stream.__anext__()
        assert engine.queue_depth()[0] == 1
        closed_at = engine.engine.steps
        await stream.aclose()
        for _ in range(200):
            if engine.queue_depth() == (0, 0):
                return engine.engine.steps - closed_at
            await asyncio.sleep(0.005)
        return None

    steps = asyncio.run(main())
    # The step running when the client left may finish; the next one frees the slot.
    assert steps is not None and steps <= 2, steps
    assert engine.engine.aborted == aborted + 1


def test_timeout_ends_the_request(setup):
    """A deadline ends the request in the engine as TIMEOUT: its slot frees, its text so far is
    finished text (the history gets it), and it is not counted as an abort."""
    engine, cases = setup
    from lookahead_core.engine.host.async_engine import RequestTimeout
    aborted, written = engine.engine.aborted, engine.engine.knowledge.history.written

    async def main():
        got = []
        with pytest.raises(RequestTimeout, match="timed out after 0.05 s"):
            async for step in engine.generate(req("slow", cases[1][0], 500), timeout_s=0.05):
                got += step.tokens
        return got

    t0 = time.perf_counter()
    got = asyncio.run(main())
    assert time.perf_counter() - t0 < 0.5 and len(got) < 500
    wait_until(lambda: engine.queue_depth() == (0, 0), 1, interval=0.01)
    assert engine.queue_depth() == (0, 0) and engine.alive
    assert engine.engine.aborted == aborted and engine.engine.knowledge.history.written > written + len(got)


def test_invalid_request_raises_before_streaming(setup):
    engine, _ = setup

    async def main():
        async for _ in engine.generate(req("big", [5, 6], 10_000)):
            pass

    with pytest.raises(ValueError, match="max_new_tokens"):
        asyncio.run(main())
    assert engine.queue_depth() == (0, 0)  # refused by the engine thread before it was queued


def test_callers_share_nothing_with_the_engine_thread_but_the_command_queue(setup):
    """Requests finish, abort and are read from (depth, step costs) while the engine steps; the
    only writes across threads are commands. The race the old per-replica router had (a dict
    popped on the event loop while the engine thread iterated it) has no counterpart left."""
    engine, cases = setup
    assert not hasattr(engine, "before_step")
    reads, stop = [], threading.Event()

    def reader():  # polls as /health and the autoscaler do, a thousand times faster
        while not stop.wait(0.001):
            reads.append((engine.queue_depth(), engine.engine.runner.costs.table()))

    async def one(i):
        stream = engine.generate(req(f"race{i}", cases[i % 4][0], 24, LookaheadParams(3, 2, 2) if i % 2 else None))
        got = []
        async for step in stream:
            got += step.tokens
            if i % 3 == 0 and len(got) >= 3:
                await stream.aclose()  # an abort from the caller's side, mid-stream
                return None
        return got

    async def main():
        return await asyncio.gather(*(one(i) for i in range(12)))

    t = threading.Thread(target=reader)
    t.start()
    try:
        results = asyncio.run(main())
    finally:
        stop.set()
        t.join()
    for i, got in enumerate(results):
        if i % 3:
            assert got == cases[i % 4][1]
    assert engine.alive and reads


def test_an_engine_whose_steps_all_raise_reports_itself_failing():
    """One failed step fails its requests and the engine serves on; steps that raise every time
    (a broken graph, a device error) make `health_error` say so, and one good step clears it."""
    model = build_random_model("llama")
    engine = Engine(model, EngineConfig(max_batch=2, prefill_chunk=16, max_new_tokens=16))
    front = AsyncEngine(engine, failing_after=2)
    good_step = engine.step
    engine.step = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))

    async def one(i):
        return [step.finish_reason async for step in front.generate(req(f"f{i}", [5, 6, 7], 4))][-1]

    try:
        with pytest.raises(RuntimeError, match="engine step failed: device lost"):
            asyncio.run(one(0))
        assert front.health_error() is None  # one failure: the engine starts clean and serves on
        with pytest.raises(RuntimeError, match="device lost"):
            asyncio.run(one(1))
        assert front.health_error() == "the engine's last 2 steps raised; the last: RuntimeError: device lost"
        engine.step = good_step
        assert asyncio.run(one(2)) == "length"
        assert front.health_error() is None and front.alive
    finally:
        front.shutdown()
    assert front.health_error() == "the engine thread is not running"


def test_callers_get_the_limits_and_the_lookahead_a_request_runs_without_the_engine(setup):
    engine, _ = setup
    assert engine.limits == EngineLimits(max_new_tokens=512, max_seq_len=engine.engine.max_seq_len)
    assert engine.resolve(req("r", [5], 4)) is None
    assert engine.resolve(req("r", [5], 4, "auto")) == engine.engine.config.lookahead
    assert engine.resolve(req("r", [5], 4, LookaheadParams(3, 2, 2))) == LookaheadParams(3, 2, 2)
    with pytest.raises(ValueError, match="n=99 exceeds"):
        engine.resolve(req("r", [5], 4, LookaheadParams(99, 2, 2)))


def test_a_request_the_caller_finished_still_ends_with_the_engines_count(setup):
    """After `finish`, the stream goes on to an output with the finish reason and the request's
    stats: every step it ran, those past the caller's end included."""
    engine, cases = setup

    async def main():
        outs = []
        async for out in engine.generate(req("fin", cases[2][0], 500, LookaheadParams(3, 2, 2))):
            outs.append(out)
            if len(outs) == 2:
                engine.finish("fin", FinishReason.STOP, kept=1)
        return outs

    outs = asyncio.run(asyncio.wait_for(main(), 30))
    last = outs[-1]
    assert last.finish_reason == "stop" and last.stats is not None and len(outs) < 500
    assert last.stats.steps == sum(1 for o in outs if o.tokens) >= 2
    assert last.stats.new_tokens == sum(len(o.tokens) for o in outs)


def test_shutdown_ends_the_streams_it_leaves_open():
    """A caller reading a stream when the engine stops hears so, instead of waiting forever."""
    front = AsyncEngine(Engine(build_random_model("llama"), EngineConfig(max_batch=1, prefill_chunk=16,
                                                                         max_new_tokens=512)))

    async def main():
        stream = front.generate(req("left", [5, 6, 7], 500))
        await stream.__anext__()
        front.shutdown()
        with pytest.raises(RuntimeError, match="the engine thread stopped"):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(main(), 10))
    assert not front.alive


def test_status_is_read_at_most_every_half_second_and_never_waits_past_its_timeout(monkeypatch):
    """A flood of /health probes reads the engine's status once per `max_age_s`, all callers in
    between sharing it; while the engine is busy past `timeout_s` the last read comes back with its age."""
    from lookahead_core.engine.host import engine_loop

    reads, hold = [], threading.Event()
    real = engine_loop.engine_status

    def counted(engine):
        reads.append(time.monotonic())
        hold.wait(10)  # a long step, where the test says
        return real(engine)

    monkeypatch.setattr(engine_loop, "engine_status", counted)
    engine = AsyncEngine(Engine(build_random_model("llama"), EngineConfig(max_batch=2, max_new_tokens=8)))
    try:
        async def flood():
            hold.set()
            first = await asyncio.gather(*(engine.status() for _ in range(50)))
            assert len(reads) == 1 and all(s is first[0] for s in first)
            again = await engine.status()  # within max_age_s: the same read
            assert again is first[0] and len(reads) == 1
            hold.clear()
            late = await engine.status(max_age_s=0.0, timeout_s=0.2)  # the engine is held: the last read, aged
            assert late["age_s"] >= 0.2
            assert {k: v for k, v in late.items() if k != "age_s"} == first[0] and len(reads) == 2
            hold.set()

        asyncio.run(flood())
    finally:
        hold.set()
        engine.shutdown()

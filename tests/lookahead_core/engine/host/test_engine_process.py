"""The engine in a process of its own (`EngineProcess`) behind the same `AsyncEngine`."""
import asyncio
import functools
import os
import signal

import pytest

from lookahead_core import LookaheadParams
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.host.async_engine import AsyncEngine, EngineStopped
from lookahead_core.engine.host.engine_process import EngineProcess
from lookahead_core.models.random_models import build_random_model
from tests.fixtures import wait_until
from tests.lookahead_core.helpers import random_prompts, req

CONFIG = EngineConfig(max_batch=4, prefill_chunk=16, max_new_tokens=512)


def build(config: EngineConfig = CONFIG, fail: str | None = None):
    """Runs in the engine's process (spawned: it must be importable by name)."""
    if fail is not None:
        raise ValueError(fail)
    return Engine(build_random_model("llama", seed=5), config), {"pid": os.getpid()}


async def collect(front: AsyncEngine, requests) -> list[list[int]]:
    async def one(r):
        return [t async for out in front.generate(r) for t in out.tokens]

    return await asyncio.gather(*(one(r) for r in requests))


@pytest.fixture(scope="module")
def process_front():
    front = AsyncEngine(EngineProcess(build))
    yield front
    front.shutdown()


def requests(prefix: str):
    params = [None, LookaheadParams(3, 2, 2), "auto", LookaheadParams(4, 3, 3)]
    return [req(f"{prefix}{i}", p, 20, params[i]) for i, p in enumerate(random_prompts(4, 512, seed=3))]


def test_an_engine_in_its_own_process_streams_what_the_engine_thread_streams(process_front):
    assert process_front.host.facts["pid"] != os.getpid() and process_front.engine is None
    here = AsyncEngine(build()[0])
    try:
        expected = asyncio.run(collect(here, requests("t")))
    finally:
        here.shutdown()
    got = asyncio.run(collect(process_front, requests("p")))
    assert got == expected and all(len(t) == 20 for t in got)
    assert process_front.limits == here.limits and process_front.resolve(requests("r")[2]) == CONFIG.lookahead


def test_refusals_and_status_come_back_from_the_process(process_front):
    too_long = req("long", [5, 6], 10_000)
    with pytest.raises(ValueError, match="max_new_tokens=10000 exceeds"):
        asyncio.run(collect(process_front, [too_long]))
    status = asyncio.run(process_front.status())
    assert status["engine"]["pid"] == process_front.host.facts["pid"] and status["engine"]["steps"] > 0
    assert process_front.health_error() is None and process_front.queue_depth() == (0, 0)


def test_a_build_that_raises_raises_in_the_caller():
    with pytest.raises(ValueError, match="no such model"):
        EngineProcess(functools.partial(build, fail="no such model"))


def test_an_engine_process_that_dies_ends_its_streams_and_reports_itself():
    front = AsyncEngine(EngineProcess(build))

    async def main():
        stream = front.generate(req("left", [5, 6, 7], 500))
        await stream.__anext__()
        os.kill(front.host.pid, signal.SIGKILL)
        with pytest.raises(EngineStopped, match="the engine process stopped"):
            async for _ in stream:
                pass

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        assert wait_until(lambda: front.health_error() == "the engine process is not running", timeout_s=10)
        with pytest.raises(RuntimeError, match="the engine process stopped"):  # later callers hear it at once
            asyncio.run(asyncio.wait_for(collect(front, [req("late", [5], 4)]), 10))
    finally:
        front.shutdown()

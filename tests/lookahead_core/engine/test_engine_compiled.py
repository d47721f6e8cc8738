"""The engine on its compiled graphs: "on" ready before the first step, "auto" serving eagerly
while the graphs compile in a worker, the eager tokens either way; graphs that raise leave the
requests to the eager forward; an idle engine thread times the graphs and stops for a command."""
import time

import pytest

from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.host.engine_loop import AddCommand, EngineThread
from lookahead_core.engine.host.status import graph_status
from lookahead_core.engine.io import EngineRequest
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.stopping import StopCondition
from lookahead_core.models.random_models import build_random_model
from tests.fixtures import wait_until

pytestmark = pytest.mark.compile

PROMPTS = [[5, 9, 5, 9, 17, 3, 5, 9], [40, 41, 42, 7, 40, 41], [100, 3, 77, 100, 3]]
# the graph holds every step these modes can take: a wider one runs eagerly, and the planner, pricing
# widths by time, may try one
ENGINE = dict(max_batch=4, max_seq_len=48, max_new_tokens=24, prefill_chunk=16, shared_pool_cap=0, compile_max_width=64)
MODES = ["off", "auto", LookaheadParams(3, 2, 2, lookup=4)]


@pytest.fixture(scope="module")
def model():
    return build_random_model("llama", vocab_size=256)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(tmp_path_factory.mktemp("engine-graphs"))


def _serve(engine: Engine, prompts, lookahead) -> dict:
    """Run requests together to the end: {request id: tokens}."""
    out = {}
    for i, (prompt, mode) in enumerate(zip(prompts, lookahead)):
        engine.add_request(EngineRequest(i, tuple(prompt), StopCondition(24), mode))
        out[i] = []
    while engine.has_work():
        for o in engine.step():
            out[o.seq_id] += o.tokens
    return out


def test_engine_compile_on_gives_eager_tokens(model, store):
    """Plain and lookahead rows, alone and batched, every step in the one decode graph and the
    prompts of slots after the first in the prefill graph: the eager engine's tokens."""
    assert max(LookaheadParams().max_step_tokens, MODES[2].max_step_tokens) <= ENGINE["compile_max_width"]
    eager = _serve(Engine(model, EngineConfig(**ENGINE)), PROMPTS, MODES)
    engine = Engine(model, EngineConfig(**ENGINE, compile="on", compile_dir=store, compile_workers=2))
    assert all(b["ready"] for b in graph_status(engine))
    assert _serve(engine, PROMPTS, MODES) == eager
    assert _serve(engine, PROMPTS[:1], ["off"]) == {0: eager[0]}
    decode, prefill = graph_status(engine)
    assert decode["calls"] > 10 and prefill["calls"] >= 2, (decode, prefill)
    assert engine.runner.eager_forwards == 0
    assert decode["served_ms"]["b1t1"] > 0


def test_engine_requests_complete_when_every_graph_raises(model, store):
    eager = _serve(Engine(model, EngineConfig(**ENGINE)), PROMPTS, MODES)
    engine = Engine(model, EngineConfig(**ENGINE, compile="on", compile_dir=store))

    def broken(inputs):
        raise RuntimeError("graph replay failed")

    for g in engine.runner.graphs.graphs.values():
        g.run = broken
    assert _serve(engine, PROMPTS, MODES) == eager
    assert engine.runner.graphs.graph_failures == 2 and not engine.runner.graphs.ready  # the decode and prefill graphs
    assert engine.runner.eager_forwards > 2 and engine.runner.graphs.calls == 0


def test_engine_compile_auto_serves_while_compiling(model, tmp_path):
    """"auto" returns at once: the first requests run eagerly while the graph compiles in a worker
    process, and run compiled once it is ready, with the same tokens throughout."""
    config = EngineConfig(**ENGINE, compile="auto", compile_dir=str(tmp_path), compile_prefill=False)
    eager = _serve(Engine(model, EngineConfig(**ENGINE)), PROMPTS[:1], ["off"])
    started = time.perf_counter()
    engine = Engine(model, config)
    assert time.perf_counter() - started < 5 and graph_status(engine)[0]["ready"] is False
    assert _serve(engine, PROMPTS[:1], ["off"]) == eager
    assert engine.runner.eager_forwards > 0
    assert engine.runner.graphs.wait(timeout=600)
    assert _serve(engine, PROMPTS[:1], ["off"]) == eager  # the step that takes the graph over
    (graph,) = graph_status(engine)
    assert graph["ready"] and graph["compile_s"] > 0 and graph["cached"] is False and "error" not in graph
    assert graph["calls"] > 0


def test_an_idle_engine_thread_times_the_graphs_and_a_request_waits_one_call_at_most(model, store):
    """Served ("auto", the graphs stored), the engine's own thread times each graph cell by cell
    between requests; a request that arrives meanwhile is taken at the next graph call."""
    engine = Engine(model, EngineConfig(**ENGINE, compile="auto", compile_dir=store))
    assert engine.runner.graphs.wait(60)
    events = []
    host = EngineThread(engine)
    host.start(events.append)
    try:
        assert wait_until(lambda: any(g["alone_ms"] for g in graph_status(engine)), 60)
        host.submit(AddCommand(1, EngineRequest("r", tuple(PROMPTS[0]), StopCondition(4), "off")))
        assert wait_until(lambda: any(getattr(e, "ticket", None) == 1 for e in events), 10)
        assert wait_until(lambda: engine.runner.graphs.timed, 120)
    finally:
        host.shutdown()
    decode = graph_status(engine)[0]
    assert decode["timed_alone"] and all(ms > 0 for ms in decode["alone_ms"].values())

"""DecodeGraphs against the eager forward on a tiny random llama: one decode graph runs every
batch, width and key count with the eager tokens, logits and KV writes; the prefill graph runs a
prompt chunk of any slot; both read the runner's own weight tensors; a graph that raises or does not
compute the served step is dropped; timing alone stops for a pending command. The graphs compile
once per session in worker processes (`graph_store`) and load from there in each test."""
import shutil
import subprocess
import sys

import pytest
import torch

from lookahead_core.engine.graphs import decode_graphs as decode_graphs_module
from lookahead_core.engine.graphs.buckets import Bucket
from lookahead_core.engine.graphs.package_store import PackageStore
from lookahead_core.engine.graphs.retries import Retries
from lookahead_core.engine.host.status import graphs_status
from lookahead_core.engine.runner.kv_cache import BatchKVCache
from lookahead_core.engine.runner.model_runner import ModelRunner
from lookahead_core.models.random_models import build_random_model
from tests.fixtures import wait_until

pytestmark = pytest.mark.compile

CAP = 64
MIN = torch.finfo(torch.float32).min
PREFILLED = [20, 33, 25, 12]  # slot 3 stands for a sequence being prefilled: no decode row
DECODE, PREFILL = Bucket(4, 8, CAP - 1), Bucket(1, 16, CAP - 1, prefill=True)


@pytest.fixture(scope="module")
def model():
    return build_random_model("llama", vocab_size=256)


@pytest.fixture(scope="module")
def graph_store(tmp_path_factory, model):
    """The two graphs of these tests, compiled once (in parallel workers) for the module."""
    store = PackageStore(tmp_path_factory.mktemp("graphs"))
    runner = _runner(model, store)
    assert not runner.graphs.failed and runner.graphs.ready == {DECODE, PREFILL}
    return store


def _prefilled(runner: ModelRunner) -> BatchKVCache:
    cache = runner.cache
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for slot, n in enumerate(PREFILLED):
            ids = torch.randint(2, 256, (1, n), generator=gen)
            causal = torch.full((n, n), MIN).triu_(1)[None, None]
            cache.prepare_slot(slot, 0, n)
            runner._eager(ids, torch.arange(n)[None], causal, cache)
            cache.lengths[slot] = n
    return cache


def _runner(model, store: PackageStore | None = None, buckets=(DECODE, PREFILL), **kwargs) -> ModelRunner:
    """A runner over `model` with its KV slots prefilled, its graphs ready (`store`) or none."""
    runner = ModelRunner(model)
    runner.allocate(4, CAP, 8)
    _prefilled(runner)
    if store is not None:
        runner.build_graphs(buckets, "on", store, workers=2, **kwargs).start()
    return runner


def _step(rows: int, width: int, seed: int):
    """Ids, positions, write offsets and a block-causal mask for slots [0, rows) at their lengths."""
    gen = torch.Generator().manual_seed(seed)
    lengths = PREFILLED[:rows]
    kv_len = max(lengths) + width
    ids = torch.randint(2, 256, (rows, width), generator=gen)
    offsets = torch.tensor(lengths)[:, None] + torch.arange(width)
    mask = torch.full((rows, 1, width, kv_len), MIN)
    for b, n in enumerate(lengths):
        mask[b, 0, :, :n] = 0.0
        mask[b, 0, :, n : n + width] = torch.full((width, width), MIN).triu_(1)
    return ids, offsets.clone(), offsets, mask, kv_len


def _decode(runner: ModelRunner, rows: int, width: int, seed: int):
    ids, pos, widx, mask, kv_len = _step(rows, width, seed)
    runner.cache.prepare_rows(rows, widx, kv_len)
    with torch.inference_mode():
        tokens, logits = runner.decode(ids, pos, mask, runner.cache)
    return tokens.tolist(), logits.clone()


def _same_writes(eager: BatchKVCache, compiled: BatchKVCache) -> None:
    for le, lc in zip(eager.layers, compiled.layers):
        for te, tc in ((le.keys, lc.keys), (le.values, lc.values)):
            # every column but the scratch one, which a graph's probe and timings write
            torch.testing.assert_close(tc[:, :, : CAP - 1], te[:, :, : CAP - 1], rtol=1e-5, atol=1e-5)


def test_one_decode_graph_runs_every_batch_width_and_key_count_as_the_eager_forward(model, graph_store):
    eager, compiled = _runner(model), _runner(model, graph_store)
    graphs = compiled.graphs
    for seed, (rows, width) in enumerate([(1, 1), (2, 1), (3, 5), (1, 8), (4, 2), (2, 3), (3, 8)]):
        ref_tokens, ref_logits = _decode(eager, rows, width, seed)
        tokens, logits = _decode(compiled, rows, width, seed)
        assert tokens == ref_tokens, (rows, width)
        assert logits.shape == ref_logits.shape == (rows, width, 256)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        _same_writes(eager.cache, compiled.cache)
    assert graphs.graphs[DECODE].calls == 7 and compiled.eager_forwards == 0
    mask = graphs.graphs[DECODE].staging.inputs()[2]
    assert mask.shape == (3, 1, 8, 41)  # the step's own batch, width and keys: nothing padded


def test_steps_outside_every_graph_run_eagerly(model, graph_store):
    eager, compiled = _runner(model), _runner(model, graph_store)
    graphs = compiled.graphs
    compiled.cache.prepare_rows(2, torch.zeros(2, 1, dtype=torch.long), CAP)
    assert graphs.can_run(2, 1, CAP, compiled.cache) is None  # would reach the scratch column
    assert graphs.can_run(2, 9, 40, compiled.cache) is None  # wider than the decode graph
    tokens, _ = _decode(compiled, 1, 12, 4)
    assert tokens == _decode(eager, 1, 12, 4)[0] and compiled.eager_forwards == 1 and graphs.calls == 0


def test_a_prompt_chunk_of_any_slot_prefills_in_the_prefill_graph(model, graph_store):
    """A chunk of whichever slot the cache is prepared for, reading that slot's keys: the eager
    prefill's last-row logits and KV writes; with every row's logits asked (prompt logprobs) a chunk
    of slot 0 runs in the decode graph and one of another slot eagerly."""
    eager, compiled = _runner(model), _runner(model, graph_store)
    prefill = compiled.graphs.graphs[PREFILL]
    for slot, width in ((1, 6), (2, 3), (0, 8), (3, 1), (1, 16)):
        ids = torch.randint(2, 256, (1, width), generator=torch.Generator().manual_seed(slot))
        start = PREFILLED[slot]
        mask = torch.zeros((1, 1, width, start + width))
        mask[0, 0, :, start:] = torch.full((width, width), MIN).triu_(1)
        with torch.inference_mode():
            for runner in (eager, compiled):
                runner.cache.prepare_slot(slot, start, width)
            ref = eager.prefill(ids, start, eager.cache, mask, all_logits=True)
            logits = compiled.prefill(ids, start, compiled.cache, mask)
        assert logits.shape == (1, 1, 256)
        torch.testing.assert_close(logits[0, -1], ref[0, -1], rtol=1e-4, atol=1e-4)
        _same_writes(eager.cache, compiled.cache)
    assert prefill.calls == 5
    with torch.inference_mode():
        ids = torch.randint(2, 256, (1, 4), generator=torch.Generator().manual_seed(9))
        for slot, graph_calls in ((0, 1), (2, 0)):
            start = PREFILLED[slot]
            compiled.cache.prepare_slot(slot, start, 4)
            before = compiled.graphs.graphs[DECODE].calls
            every = compiled.prefill(ids, start, compiled.cache, torch.zeros((1, 1, 4, start + 4)), all_logits=True)
            assert every.shape == (1, 4, 256) and compiled.graphs.graphs[DECODE].calls - before == graph_calls
    assert prefill.calls == 5


def test_every_graph_reads_the_runners_own_weight_tensors(model, graph_store):
    """A package holds no weights: loaded over a model of the same shapes with other weights it
    computes that model's step, and a weight changed in place changes the graph's step as it
    changes the eager one's (the graph reads the tensor itself, not a copy)."""
    other_model = build_random_model("llama", vocab_size=256, seed=7)
    eager, compiled = _runner(other_model), _runner(other_model, graph_store)
    assert all(g["cached"] for g in graphs_status(compiled.graphs))  # the packages compiled over `model`
    ref_tokens, ref_logits = _decode(eager, 3, 4, 11)
    tokens, logits = _decode(compiled, 3, 4, 11)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        other_model.model.norm.weight.mul_(-2.0)  # the two runners share this model and its tensors
    ref_tokens, ref_logits = _decode(eager, 3, 4, 12)
    tokens, logits = _decode(compiled, 3, 4, 12)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert compiled.graphs.calls == 2 and compiled.eager_forwards == 0


def test_a_graph_that_raises_is_dropped_and_its_step_reruns_eagerly(model, graph_store):
    eager, compiled = _runner(model), _runner(model, graph_store)
    graphs = compiled.graphs

    def broken(inputs):
        raise RuntimeError("graph replay failed")

    graphs.graphs[DECODE].run = broken
    ref_tokens, ref_logits = _decode(eager, 2, 3, 9)
    tokens, logits = _decode(compiled, 2, 3, 9)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    _same_writes(eager.cache, compiled.cache)
    assert graphs.graph_failures == 1 and compiled.eager_forwards == 1 and graphs.ready == {PREFILL}
    assert [b["error"] for b in graphs_status(graphs) if "error" in b] == ["RuntimeError: graph replay failed"]


def test_a_package_that_does_not_compute_the_served_step_is_never_used(model, graph_store, tmp_path):
    """A graph is checked against the eager forward before its first step: one traced with other
    rotary frequencies (which its code holds as constants), found under the served model's name,
    is refused, and its steps run eagerly."""
    other = build_random_model("llama", vocab_size=256)
    with torch.no_grad():
        other.model.rotary_emb.inv_freq.mul_(0.5)
    runner = _runner(other)
    graphs = runner.build_graphs([DECODE], "on", PackageStore(tmp_path))
    served = _runner(model).build_graphs([DECODE], "on", graph_store).name(DECODE)
    shutil.copytree(graph_store.folder(served), graphs.store.folder(graphs.name(DECODE)))
    graphs.start()
    assert graphs.ready == set() and "differ from the eager forward" in graphs.failed[DECODE]
    _decode(runner, 2, 2, 1)
    assert runner.eager_forwards == 1


def test_timing_alone_prices_each_cell_and_stops_for_a_pending_command(model, graph_store):
    """Each ready graph is timed alone cell by cell (batch x width) on the calling thread, without
    touching a committed key, one graph call a turn: a command that arrives waits for one call at
    most, and a cell interrupted by commands (a health probe every turn) still completes."""
    runner = _runner(model, graph_store)
    graphs = runner.graphs
    before = [layer.keys[:, :, : CAP - 1].clone() for layer in runner.cache.layers]
    g = graphs.graphs[DECODE]
    calls = []
    run = g.run
    g.run = lambda inputs: calls.append(1) or run(inputs)
    assert runner.idle_turn(pending=lambda: True) is False and not calls  # a command waits: no call
    assert runner.idle_turn() and len(calls) == 1 and not g.alone_ms  # one call a turn
    while runner.idle_turn():
        assert runner.idle_turn(pending=lambda: True) is False  # a command between every two calls
    assert len(calls) == 4 * len(DECODE.timed_cells())
    assert graphs.timed and set(g.alone_ms) == set(DECODE.timed_cells())
    assert all(ms > 0 for ms in g.alone_ms.values())
    for layer, keys in zip(runner.cache.layers, before):
        assert torch.equal(layer.keys[:, :, : CAP - 1], keys)
    table = graphs.alone_costs()
    assert table[1][1] == g.alone_ms[(1, 1)] and table[4][8] == g.alone_ms[(4, 8)]
    assert runner.costs.timed_ratio(4, 8) == pytest.approx(max(g.alone_ms[(4, 8)] / g.alone_ms[(4, 1)], 1.0))


def test_a_graph_that_cannot_compile_leaves_its_steps_eager(model, tmp_path, monkeypatch):
    def fails(job, started):
        raise RuntimeError("compiling decode failed: no compiler")

    monkeypatch.setattr(decode_graphs_module, "compile_in_worker", fails)
    runner = _runner(model, PackageStore(tmp_path), buckets=(DECODE,))
    assert runner.graphs.ready == set() and "no compiler" in runner.graphs.failed[DECODE]
    assert "no compiler" in graphs_status(runner.graphs)[0]["error"]


_LOAD_AND_STEP = """
import torch
from lookahead_core.engine.graphs.buckets import Bucket
from lookahead_core.engine.graphs.package_store import PackageStore
from lookahead_core.engine.graphs.retries import Retries
from lookahead_core.engine.host.status import graphs_status
from lookahead_core.engine.runner.model_runner import ModelRunner
from lookahead_core.models.random_models import build_random_model
from tests.fixtures import wait_until
from tests.lookahead_core.engine.graphs.test_decode_graphs import _decode, _prefilled
# nothing before the graph asks Linux for AMX: oneDNN's matmul and SDPA's bf16 kernels would
torch.backends.mkldnn.enabled = False
m = build_random_model("llama", vocab_size=256, dtype=torch.bfloat16, attn_implementation="eager")
runner = ModelRunner(m, weight_layout="plain")
runner.allocate(4, CAP, 8)
_prefilled(runner)
runner.build_graphs([Bucket(4, 2, CAP - 1)], "on", PackageStore(STORE)).start()
tokens, _ = _decode(runner, 4, 1, 5)
print(graphs_status(runner.graphs)[0]["cached"], runner.graphs.calls, tokens)
"""


def test_a_bf16_graph_stored_by_one_process_runs_in_a_fresh_one(tmp_path):
    """A later start only loads its packages: a bf16 graph (AMX kernels where the CPU has AMX,
    which a process must ask Linux for before its first tile instruction) compiled here runs in a
    process that loads it and compiles nothing, with this process's tokens."""
    m = build_random_model("llama", vocab_size=256, dtype=torch.bfloat16, attn_implementation="eager")
    runner = ModelRunner(m, weight_layout="plain")
    runner.allocate(4, CAP, 8)
    _prefilled(runner)
    runner.build_graphs([Bucket(4, 2, CAP - 1)], "on", PackageStore(tmp_path)).start()
    tokens, _ = _decode(runner, 4, 1, 5)
    assert graphs_status(runner.graphs)[0]["cached"] is False and runner.graphs.calls == 1
    code = _LOAD_AND_STEP.replace("STORE", repr(str(tmp_path))).replace("CAP", str(CAP))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert child.stdout.split("\n")[-2] == f"True 1 {tokens}"


def test_closing_the_graphs_ends_a_compile_under_way(model, tmp_path):
    """A host that stops never waits on a compile: `close` kills the worker, and nothing is made
    ready or reported failed after it."""
    import time

    runner = ModelRunner(model)
    runner.allocate(4, CAP, 8)
    graphs = runner.build_graphs([DECODE], "auto", PackageStore(tmp_path))
    graphs.start()
    assert wait_until(lambda: graphs._compiling, 60)
    (worker,) = graphs._compiling
    t0 = time.perf_counter()
    runner.close()
    assert graphs.wait(30) and time.perf_counter() - t0 < 30
    assert not worker.is_alive() and not graphs.poll() and graphs.ready == set() and not graphs.failed


def test_a_dropped_graph_is_checked_again_after_its_pause_and_returns(model, graph_store):
    """A graph that raised once (memory pressure) runs again once it passes its check after a
    pause; one that keeps raising after the last pause stays dropped."""
    compiled = _runner(model, graph_store)
    graphs = compiled.graphs
    graphs.retries = Retries((0.0,))
    good, calls = graphs.graphs[DECODE].run, []

    def flaky(inputs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return good(inputs)

    graphs.graphs[DECODE].run = flaky
    ref = _decode(_runner(model), 2, 3, 9)[0]
    assert _decode(compiled, 2, 3, 9)[0] == ref and graphs.ready == {PREFILL} and DECODE in graphs.failed
    compiled.sync_graphs()  # its pause has passed: checked against the eager forward, and ready
    assert graphs.ready == {DECODE, PREFILL} and not graphs.failed
    eager = compiled.eager_forwards
    _decode(compiled, 2, 3, 9)
    assert compiled.eager_forwards == eager  # the step ran in the graph

    def broken(inputs):
        raise RuntimeError("graph replay failed")

    graphs.graphs[DECODE].run = broken
    _decode(compiled, 2, 3, 9)
    compiled.sync_graphs()
    assert graphs.ready == {PREFILL} and graphs.retries.drops[DECODE] == 2 and graphs.retries.due(float("inf")) == []

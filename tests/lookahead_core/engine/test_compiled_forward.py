"""CompiledForward against the eager forward on a tiny random llama: the same greedy tokens, the same
logits and the same KV writes, in two buckets (one holding up to a kv bucket's keys, one up to the
cache's capacity), a graph reused at other widths and key lengths without recompiling, prompt
chunks in the prefill graph, and steps outside every bucket run eagerly; and the engine on it:
compiled before the first step ("on") or in the background ("auto")."""
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from lookahead_core.engine import compiled_forward
from lookahead_core.engine.bucket_staging import Bucket
from lookahead_core.engine.compile_setup import CompileThrottle, weights_tag
from lookahead_core.engine.compiled_forward import CompiledForward
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.engine_loop import EngineThread
from lookahead_core.engine.exported_step import ExportedStep
from lookahead_core.engine.kv_cache import BatchKVCache
from lookahead_core.engine.model_runner import ModelRunner, eager_decode
from lookahead_core.engine.package_store import PackageStore
from lookahead_core.engine.request import EngineRequest
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.stopping import StopCondition
from lookahead_core.models.random_models import build_random_model
from tests.fixtures import wait_until

CAP = 64
MIN = torch.finfo(torch.float32).min
PREFILLED = [20, 33, 25, 12]  # slot 3 stands for a sequence being prefilled: no decode row


@pytest.fixture(scope="module")
def model():
    return build_random_model("llama", vocab_size=256)


def _prefilled(model) -> BatchKVCache:
    cache = BatchKVCache(model.config.num_hidden_layers, max_batch=4, capacity=CAP)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for slot, n in enumerate(PREFILLED):
            ids = torch.randint(2, 256, (1, n), generator=gen)
            causal = torch.full((n, n), MIN).triu_(1)[None, None]
            cache.prepare_slot(slot, 0, n)
            model(input_ids=ids, position_ids=torch.arange(n)[None], attention_mask=causal, past_key_values=cache, use_cache=True)
            cache.lengths[slot] = n
    return cache


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


def _eager(model):
    return lambda *args: eager_decode(model, *args)


def _graphs(model, cache, **kwargs) -> CompiledForward:
    """Graphs compiled without timing GEMM choices: 4-5x faster to compile, the same code path
    (the first test, the options test and bench_buckets' test keep the autotune)."""
    return CompiledForward(model, cache, gemm_autotune=False, **kwargs)


def _runner(cf: CompiledForward) -> ModelRunner:
    """A runner owning these graphs: a step runs in the graph that holds it, else eagerly."""
    runner = ModelRunner(cf.model)
    runner.graphs = cf
    return runner


def _run(forward, cache, rows, width, seed):
    ids, pos, widx, mask, kv_len = _step(rows, width, seed)
    cache.prepare_rows(rows, widx, kv_len)
    with torch.inference_mode():
        pred, logits = forward(ids, pos, mask, cache)
    return pred.tolist(), logits.clone()


def _same_writes(eager: BatchKVCache, compiled: BatchKVCache, rows: int, width: int) -> None:
    for le, lc in zip(eager.layers, compiled.layers):
        for te, tc in ((le.keys, lc.keys), (le.values, lc.values)):
            for b in range(rows):
                n = PREFILLED[b]
                torch.testing.assert_close(tc[b, :, : n + width], te[b, :, : n + width], rtol=1e-5, atol=1e-5)
            # nothing else moved but the scratch column: slot 3's prompt and every unused column
            torch.testing.assert_close(tc[:, :, : CAP - 1], te[:, :, : CAP - 1], rtol=1e-5, atol=1e-5)


@pytest.mark.compile
def test_compiled_forward_matches_eager_in_two_buckets(model):
    eager_cache, cache = _prefilled(model), _prefilled(model)
    cf = CompiledForward(model, cache, batch_buckets=(1, 4), width_buckets=(1, 8), kv_buckets=(32,))
    runner = _runner(cf)
    frames = torch._dynamo.utils.counters["frames"]
    steps = [(3, 5, 0), (2, 7, 1), (1, 1, 2), (3, 3, 3), (1, 1, 4)]  # (4,8,64) twice, (1,1,32), both again
    expected = [Bucket(4, 8, CAP), Bucket(4, 8, CAP), Bucket(1, 1, 32), Bucket(4, 8, CAP), Bucket(1, 1, 32)]
    seen = set()
    for (rows, width, seed), bucket in zip(steps, expected):
        assert cf.bucket_for(rows, width, max(PREFILLED[:rows]) + width) == bucket
        before = frames["ok"]
        ref_pred, ref_logits = _run(_eager(cf.model), eager_cache, rows, width, seed)
        pred, logits = _run(runner.decode, cache, rows, width, seed)
        assert pred == ref_pred
        assert logits.shape == ref_logits.shape == (rows, width, 256)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        _same_writes(eager_cache, cache, rows, width)
        if bucket in seen:
            assert frames["ok"] == before, f"bucket {bucket} recompiled"
        seen.add(bucket)
    assert cf.ready == {Bucket(4, 8, CAP), Bucket(1, 1, 32)}  # compiled on their first steps (lazy)
    assert cf.calls == 5 and runner.eager_forwards == 0


def test_a_step_runs_in_the_cheapest_ready_bucket_that_holds_it(model):
    """Buckets as an engine configures them, (batch, width) pairs, none compiled on demand: a step
    takes the cheapest ready one holding it, not the grid's rounding of each size apart."""
    cache = _prefilled(model)
    cf = CompiledForward(model, cache, batch_buckets=(1, 2, 4), width_buckets=(1, 4), compile=False, lazy=False,
                         dynamic=False)
    runner = _runner(cf)
    assert cf.ready_bucket_for(1, 1, 40) is None  # nothing ready yet: eager
    cf.warmup([Bucket(1, 1, CAP), Bucket(4, 1, CAP), Bucket(2, 4, CAP)])
    picks = {(1, 1): Bucket(1, 1, CAP), (3, 1): Bucket(4, 1, CAP), (1, 3): Bucket(2, 4, CAP), (2, 2): Bucket(2, 4, CAP),
             (2, 1): Bucket(4, 1, CAP), (3, 2): None, (5, 1): None}  # (2, 1): 4 x 1 rows beat 2 x 4
    for (rows, width), bucket in picks.items():
        assert cf.ready_bucket_for(rows, width, 40) == bucket, (rows, width)
    assert cf.bucket_for(3, 2, 40) == Bucket(4, 4, CAP)  # the grid's pick: never compiled here
    ref, _ = _run(_eager(cf.model), _prefilled(model), 3, 1, 7)
    pred, _ = _run(runner.decode, cache, 3, 1, 7)
    assert pred == ref and cf.calls == 1 and runner.eager_forwards == 0
    _run(runner.decode, cache, 3, 2, 8)
    assert cf.calls == 1 and runner.eager_forwards == 1


def test_steps_outside_every_bucket_run_eagerly(model):
    cache = _prefilled(model)
    cf = CompiledForward(model, cache, batch_buckets=(1, 2), width_buckets=(1, 4), compile=False, dynamic=False)
    runner = _runner(cf)
    assert cf.bucket_for(3, 1, 40) is None  # more rows than the largest bucket
    assert cf.bucket_for(1, 5, 40) is None  # wider than the largest bucket
    assert cf.bucket_for(1, 1, CAP) is None  # would reach the scratch column
    assert cf.bucket_for(2, 3, 40) == Bucket(2, 4, CAP)
    ref_cache = _prefilled(model)
    ref, _ = _run(_eager(cf.model), ref_cache, 3, 2, 7)
    pred, logits = _run(runner.decode, cache, 3, 2, 7)
    assert pred == ref and cf.calls == 0 and runner.eager_forwards == 1
    padded = CompiledForward(model, cache, batch_buckets=(2,), width_buckets=(4,), compile=False, dynamic=False)
    cache.lengths[1] = CAP  # the slot that would pad a one-row step holds a token in the scratch column
    padded_runner = _runner(padded)
    _run(padded_runner.decode, cache, 1, 2, 7)
    assert padded.calls == 0 and padded_runner.eager_forwards == 1
    cache.lengths[1] = PREFILLED[1]
    # uncompiled, a bucketed step pads and stages exactly as the graph would see it
    ref, ref_logits = _run(_eager(cf.model), ref_cache, 2, 3, 8)
    pred, logits = _run(runner.decode, cache, 2, 3, 8)
    assert pred == ref and cf.calls == 1
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    staged = cf._staging[Bucket(2, 4, CAP)]
    assert staged.cols[:, 3].tolist() == [CAP - 1, CAP - 1]  # padding tokens write the scratch column
    assert (staged.mask[:, 0, 3, 0] == 0).all()  # and see column 0, never nothing


@pytest.mark.compile
def test_a_dynamic_bucket_runs_every_width_and_key_length_in_one_graph(model):
    """A (2, 8) bucket of dynamic shape: steps 1 to 8 tokens wide, of one row or two, attending to
    14 to 41 keys, run in one graph at their own width (a one-token step at two) and key length,
    with the eager tokens, logits and KV writes; the step is priced at its own width against the
    other ready buckets."""
    eager_cache, cache = _prefilled(model), _prefilled(model)
    cf = _graphs(model, cache, batch_buckets=(1, 2), width_buckets=(1, 8), kv_buckets=(CAP,), lazy=False)
    runner = _runner(cf)
    cf.warmup([Bucket(1, 1, CAP), Bucket(2, 8, CAP)])
    assert cf.is_dynamic(Bucket(2, 8, CAP)) and not cf.is_dynamic(Bucket(1, 1, CAP))
    assert cf.ready_bucket_for(1, 1, 40) == Bucket(1, 1, CAP)
    assert cf.ready_bucket_for(1, 3, 40) == cf.ready_bucket_for(2, 1, 40) == Bucket(2, 8, CAP)
    cf.ready.add(Bucket(2, 2, CAP))  # a static bucket of the step's own width wins the tie
    assert cf.ready_bucket_for(2, 2, 40) == Bucket(2, 2, CAP) and cf.ready_bucket_for(2, 3, 40) == Bucket(2, 8, CAP)
    cf.ready.discard(Bucket(2, 2, CAP))
    frames = torch._dynamo.utils.counters["frames"]
    before = frames["ok"]
    for seed, (rows, width) in enumerate([(2, 1), (1, 2), (2, 3), (1, 8), (2, 5), (2, 8)]):
        ref_pred, ref_logits = _run(_eager(cf.model), eager_cache, rows, width, seed)
        pred, logits = _run(runner.decode, cache, rows, width, seed)
        assert pred == ref_pred, (rows, width)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        _same_writes(eager_cache, cache, rows, width)
        mask = cf._staging[Bucket(2, 8, CAP)].inputs()[2]
        assert mask.shape[2:] == (max(width, 2), max(PREFILLED[:rows]) + width)  # unpadded width and keys
    assert frames["ok"] == before, "a width or key length recompiled"
    assert cf.calls == 6 and cf._staging[Bucket(2, 8, CAP)].calls == 7  # and the warm-up


def test_narrow_steps_run_in_the_graph_tuned_at_their_width(model):
    """A narrow dynamic bucket is compiled (each GEMM timed) at its narrowest step, a wide one at
    8 tokens, a prefill one at 32: a step of 2 to 4 tokens takes the narrow graph, wider steps the
    wide one, a one-token step the static graph."""
    cache = _prefilled(model)
    cf = _graphs(model, cache, batch_buckets=(1,), width_buckets=(1, 4, 16), kv_buckets=(CAP,), lazy=False)
    static, narrow, wide = Bucket(1, 1, CAP), Bucket(1, 4, CAP), Bucket(1, 16, CAP)
    assert (narrow.tune_width, wide.tune_width, Bucket(1, 48, CAP, prefill=True).tune_width) == (2, 8, 32)
    assert [cf._stage_for(b).inputs()[0].shape[1] for b in (narrow, wide)] == [2, 8]  # the views it compiles with
    cf.ready |= {static, narrow, wide}
    assert [cf.ready_bucket_for(1, w, 40) for w in (1, 2, 3, 4, 5, 16)] == [static, narrow, narrow, narrow, wide, wide]
    cf.ready.discard(narrow)
    assert cf.ready_bucket_for(1, 3, 40) == wide


def test_ready_graphs_are_timed_alone_at_each_width_and_price_the_steps_not_yet_run(model):
    """Right after its warm-up each decode graph is timed alone at every width of TIMED_WIDTHS it
    runs (a one-token graph at one; a wide one at its own, a one-token step at two), without
    touching a committed key; per batch, each width is then priced at what it costs in the graph
    that would run it, and the runner's step costs start from that table."""
    cache, untouched = _prefilled(model), _prefilled(model)
    cf = _graphs(model, cache, batch_buckets=(1, 4), width_buckets=(1, 8), kv_buckets=(CAP,),
              compile=False, lazy=False)
    runner = _runner(cf)
    one, wide = Bucket(1, 1, CAP), Bucket(4, 8, CAP)
    cf.warmup([one, wide])
    alone = {b: st.alone_ms for b, st in cf._staging.items()}
    assert list(alone[one]) == [1] and list(alone[wide]) == [2, 3, 4, 6, 8]
    assert all(ms > 0 for cells in alone.values() for ms in cells.values())
    _same_writes(untouched, cache, 0, 0)
    table = cf.alone_costs()
    assert table[1] == {1: alone[one][1], 2: alone[wide][2], 3: alone[wide][3], 4: alone[wide][4],
                        6: alone[wide][6], 8: alone[wide][8]}  # steps of 2-8 tokens run in the wide graph
    assert table[2] == table[4] == {1: alone[wide][2], **{w: alone[wide][w] for w in (2, 3, 4, 6, 8)}}
    _run(runner.decode, cache, 1, 1, 0)  # the runner reads the ready graphs' timings
    assert runner.costs.timed_ratio(4, 6) == pytest.approx(max(alone[wide][6] / alone[wide][2], 1.0))
    assert runner.costs.ratio(3, 6) == runner.costs.timed_ratio(4, 6)  # nothing run at batch 3-4 yet
    busy = CompiledForward(model, _prefilled(model), batch_buckets=(1,), width_buckets=(1,), kv_buckets=(CAP,),
                           compile=False, lazy=False)
    busy.busy = True  # the engine is stepping: a timing would not be alone
    busy.warmup([one])
    assert busy._staging[one].alone_ms == {} and busy.alone_costs() == {}
    assert [b["timed_alone"] for b in cf.status()] == [True, True] and busy.status()[0]["timed_alone"] is False


def test_graphs_of_three_or_four_rows_take_the_gemm_template(model):
    """One-token steps of 3 or 4 sequences and a narrow bucket of one take inductor's C++ GEMM
    template only; one or two rows, 8 rows and more, and prompt chunks are autotuned between the
    template and the library kernels."""
    cf = CompiledForward(model, _prefilled(model), batch_buckets=(1, 2, 3, 4), width_buckets=(1, 4, 16), kv_buckets=(CAP,))
    backends = {(b, w): cf.options_for(Bucket(b, w, CAP))["max_autotune_gemm_backends"]
                for b in (1, 2, 3, 4) for w in (1, 4, 16)}
    assert backends == {(1, 1): "CPP,ATEN", (1, 4): "CPP", (1, 16): "CPP,ATEN",
                        (2, 1): "CPP,ATEN", (2, 4): "CPP,ATEN", (2, 16): "CPP,ATEN",
                        (3, 1): "CPP", (3, 4): "CPP,ATEN", (3, 16): "CPP,ATEN",
                        (4, 1): "CPP", (4, 4): "CPP,ATEN", (4, 16): "CPP,ATEN"}
    assert cf.options_for(Bucket(1, 3, CAP))["max_autotune_gemm_backends"] == "CPP"
    assert cf.options_for(Bucket(1, 4, CAP, prefill=True))["max_autotune_gemm_backends"] == "CPP,ATEN"
    assert cf.options_for(Bucket(4, 1, CAP))["freezing"] is True


@pytest.mark.compile
def test_a_step_runs_in_its_own_buckets_graph(model):
    """A narrow bucket compiled before a wide one of the same batch: a step of 3 tokens runs in
    the narrow bucket's graph, not in the wide one's, which admits it too; each bucket has a
    package of its own."""
    eager_cache, cache = _prefilled(model), _prefilled(model)
    cf = _graphs(model, cache, batch_buckets=(2,), width_buckets=(4, 8), kv_buckets=(CAP,), lazy=False)
    narrow, wide = Bucket(2, 4, CAP), Bucket(2, 8, CAP)
    cf.warmup([narrow, wide])
    ref_pred, ref_logits = _run(_eager(cf.model), eager_cache, 2, 3, 5)
    pred, logits = _run(_runner(cf).decode, cache, 2, 3, 5)
    assert pred == ref_pred
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert (cf._staging[narrow].calls, cf._staging[wide].calls) == (2, 1)  # and each one's warm-up
    graphs = [cf._staging[b].graph for b in (narrow, wide)]
    assert all(isinstance(g, ExportedStep) and g.stored() for g in graphs)
    assert graphs[0].name != graphs[1].name  # a package each


@pytest.mark.compile
def test_a_prompt_chunk_in_the_first_slot_prefills_in_a_graph(model):
    """A prompt chunk for slot 0 (a request that arrives alone) runs in the ready graph that holds
    it: the eager prefill's last-row logits and KV writes; a chunk for another slot runs eagerly."""
    eager_cache, cache = _prefilled(model), _prefilled(model)
    cf = _graphs(model, cache, batch_buckets=(1,), width_buckets=(8,), kv_buckets=(CAP,), lazy=False)
    cf.warmup([Bucket(1, 8, CAP)])
    runner, eager = _runner(cf), ModelRunner(model)
    ids = torch.randint(2, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    start = PREFILLED[0]
    mask = torch.zeros((1, 1, 6, start + 6))
    mask[0, 0, :, start:] = torch.full((6, 6), MIN).triu_(1)
    with torch.inference_mode():
        for c in (eager_cache, cache):
            c.prepare_slot(0, start, 6)
        ref = eager.prefill(ids, start, eager_cache, mask)
        logits = runner.prefill(ids, start, cache, mask)
        assert cf.calls == 1 and logits.shape == (1, 6, 256)
        torch.testing.assert_close(logits[0, -1], ref[0, -1], rtol=1e-4, atol=1e-4)
        _same_writes(eager_cache, cache, 1, 6)
        cache.prepare_slot(1, PREFILLED[1], 6)
        runner.prefill(ids, PREFILLED[1], cache, torch.zeros((1, 1, 6, PREFILLED[1] + 6)))
        assert cf.calls == 1  # slot 1: eager


@pytest.mark.compile
def test_a_prompt_chunk_of_any_slot_prefills_in_the_prefill_graph(model):
    """The prefill graph runs a chunk of whichever slot the cache is prepared for, reading that
    slot's keys: the eager prefill's last-row logits (the only row it computes), and the same KV
    writes, nothing else touched; it never takes a decode step, nor a chunk whose every row's
    logits are asked for (prompt logprobs)."""
    eager_cache, cache = _prefilled(model), _prefilled(model)
    cf = _graphs(model, cache, batch_buckets=(1,), width_buckets=(1,), kv_buckets=(CAP,), lazy=False)
    prefill = Bucket(1, 8, CAP, prefill=True)
    cf.warmup([prefill])
    runner, eager = _runner(cf), ModelRunner(model)
    frames = torch._dynamo.utils.counters["frames"]
    before = frames["ok"]
    for slot, width in ((1, 6), (2, 3), (0, 8), (3, 2)):
        ids = torch.randint(2, 256, (1, width), generator=torch.Generator().manual_seed(slot))
        start = PREFILLED[slot]
        mask = torch.zeros((1, 1, width, start + width))
        mask[0, 0, :, start:] = torch.full((width, width), MIN).triu_(1)
        with torch.inference_mode():
            for c in (eager_cache, cache):
                c.prepare_slot(slot, start, width)
            ref = eager.prefill(ids, start, eager_cache, mask, all_logits=True)
            logits = runner.prefill(ids, start, cache, mask)
        assert logits.shape == (1, 1, 256)
        torch.testing.assert_close(logits[0, -1], ref[0, -1], rtol=1e-4, atol=1e-4)
        _same_writes(eager_cache, cache, 0, 0)
    assert cf._staging[prefill].calls == 5 and frames["ok"] == before  # and the warm-up; no recompile
    assert cf.ready_bucket_for(1, 2, 40) is None  # decode steps never run in it
    cache.prepare_slot(1, PREFILLED[1], 2)
    with torch.inference_mode():
        every = runner.prefill(ids[:, :2], PREFILLED[1], cache, torch.zeros((1, 1, 2, PREFILLED[1] + 2)), all_logits=True)
    assert every.shape == (1, 2, 256) and cf._staging[prefill].calls == 5  # eagerly


def test_a_graph_that_raises_is_dropped_and_its_step_reruns_eagerly(model):
    """A ready graph that raises on a step: that step still returns the eager result (same KV
    writes), the bucket turns failed, and later steps take another ready bucket or run eagerly."""
    cache, ref_cache = _prefilled(model), _prefilled(model)
    cf = CompiledForward(model, cache, batch_buckets=(2, 4), width_buckets=(1,), compile=False, lazy=False)
    runner = _runner(cf)
    cf.warmup([Bucket(2, 1, CAP), Bucket(4, 1, CAP)])
    def broken(*args):
        raise RuntimeError("graph replay failed")

    cf._staging[Bucket(2, 1, CAP)].graph = broken
    ref, ref_logits = _run(_eager(cf.model), ref_cache, 2, 1, 9)
    pred, logits = _run(runner.decode, cache, 2, 1, 9)
    assert pred == ref
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    _same_writes(ref_cache, cache, 2, 1)
    assert cf.graph_failures == 1 and runner.eager_forwards == 1 and cf.ready == {Bucket(4, 1, CAP)}
    assert "graph replay failed" in cf.failed[Bucket(2, 1, CAP)]
    assert [b["error"] for b in cf.status() if "error" in b] == ["RuntimeError: graph replay failed"]
    assert cf.ready_bucket_for(2, 1, 40) == Bucket(4, 1, CAP)
    _run(runner.decode, cache, 2, 1, 10)  # now in the (4, 1) graph, which works
    assert cf.graph_failures == 1 and cf.calls == 1


def test_eager_attention_keeps_its_path_while_another_thread_compiles():
    """`torch.compiler.is_compiling()` is one process-wide flag during a compile (torch 2.13): the
    engine thread's eager attention must not read it as "this forward is traced"."""
    from transformers.integrations import sdpa_attention

    from lookahead_core.engine.compile_setup import install_sdpa_gqa

    install_sdpa_gqa()
    key = torch.zeros(1, 3, 4, 8)
    mask = torch.zeros(1, 1, 1, 4)
    entered, leave = threading.Event(), threading.Event()

    def compile_session():
        with torch.compiler._compile_session_context():
            entered.set()
            leave.wait(10)

    other = threading.Thread(target=compile_session)
    other.start()
    try:
        assert entered.wait(10) and torch.compiler.is_compiling()  # the flag this thread sees
        assert sdpa_attention.use_gqa_in_sdpa(mask, key, key) is False
        assert sdpa_attention.is_torchdynamo_compiling() is False
    finally:
        leave.set()
        other.join()

    def traced(x):  # in a dynamo trace the CPU kernels take grouped-query attention with a mask
        return x + 1 if sdpa_attention.use_gqa_in_sdpa(mask, key, key) else x - 1

    assert torch.compile(traced, backend="eager")(torch.zeros(1)).item() == 1


@pytest.mark.parametrize("width", [1, 5])
def test_packed_grouped_query_attention_is_transformers_attention(width):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lookahead_core.engine.compile_setup import packed_gqa_attention

    gen = torch.Generator().manual_seed(width)
    q, k, v = (torch.randn(shape, generator=gen).to(torch.bfloat16)
               for shape in ((2, 4, width, 16), (2, 2, 9, 16), (2, 2, 9, 16)))
    mask = torch.zeros(2, 1, width, 9)
    mask[:, 0, :, 9 - width :] = torch.full((width, width), MIN).triu_(1)
    mask[1, 0, :, :3] = MIN  # keys another row does not see
    mask = mask.to(torch.bfloat16)
    ref, _ = sdpa_attention_forward(SimpleNamespace(num_key_value_groups=2, is_causal=True), q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(packed_gqa_attention(q, k, v, mask, 2, 0.25).float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_a_traced_bf16_forward_packs_grouped_query_heads(model, monkeypatch):
    """In a trace a bf16 forward's grouped-query attention runs packed, in every layer (the CPU
    kernel's `enable_gqa` path is several times slower in bf16), and gives eager's logits."""
    import copy

    from lookahead_core.engine import compile_setup

    compile_setup.install_sdpa_gqa()
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert bf16.config.num_attention_heads > bf16.config.num_key_value_heads
    calls = []
    packed = compile_setup.packed_gqa_attention
    monkeypatch.setattr(compile_setup, "packed_gqa_attention", lambda *args: calls.append(1) or packed(*args))
    ids = torch.randint(2, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.full((2, 1, 12, 12), MIN).triu_(1).to(torch.bfloat16)

    def forward(ids, mask):
        return bf16(input_ids=ids, attention_mask=mask, position_ids=torch.arange(12)[None].expand(2, 12)).logits

    with torch.inference_mode():
        eager = forward(ids, mask)
        assert not calls  # eager forwards keep transformers' attention
        torch._dynamo.reset()
        traced = torch.compile(forward, backend="eager")(ids, mask)
    assert len(calls) == bf16.config.num_hidden_layers
    torch.testing.assert_close(traced.float(), eager.float(), rtol=2e-2, atol=2e-2)


def test_warmup_compiles_without_touching_committed_keys(model):
    cache = _prefilled(model)
    before = [layer.keys[:, :, : CAP - 1].clone() for layer in cache.layers]
    cf = CompiledForward(model, cache, batch_buckets=(2,), width_buckets=(2,), compile=False)
    seconds = cf.warmup([(2, 2, CAP)])
    assert list(seconds) == [Bucket(2, 2, CAP)]
    for layer, keys in zip(cache.layers, before):
        assert torch.equal(layer.keys[:, :, : CAP - 1], keys)


# ---- the engine on its compiled forward ------------------------------------------------------

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


PROMPTS = [[5, 9, 5, 9, 17, 3, 5, 9], [40, 41, 42, 7, 40, 41], [100, 3, 77, 100, 3]]
ENGINE = dict(max_batch=4, max_seq_len=48, max_new_tokens=24, prefill_chunk=16, shared_pool_cap=0, compile_autotune=False)


@pytest.mark.compile
def test_engine_compile_on_gives_eager_tokens(model):
    """Plain and lookahead rows, alone and batched, through buckets compiled before the first step:
    the same tokens as the eager engine, and the steps did run compiled, prompts of slots after the
    first in the prefill graph."""
    modes = ["off", "auto", LookaheadParams(3, 2, 2, lookup=4)]
    eager = _serve(Engine(model, EngineConfig(**ENGINE)), PROMPTS, modes)
    engine = Engine(model, EngineConfig(**ENGINE, compile="on", compile_buckets=[(1, 1), (4, 16)], compile_kv=[64]))
    assert all(b["ready"] for b in engine.compile_status())
    assert _serve(engine, PROMPTS, modes) == eager
    assert _serve(engine, PROMPTS[:1], ["off"]) == {0: eager[0]}  # one row, one token: the (1, 1) graph
    calls = {(b["batch"], b["width"], b.get("prefill", False)): b["calls"] for b in engine.compile_status()}
    assert calls[(4, 16, False)] > 1 and calls[(1, 1, False)] > 1, calls
    assert calls[(1, 16, True)] >= 3, calls  # the warm-up, and the prompts of slots 1 and 2
    status = {(b["batch"], b["width"], b.get("prefill", False)): b for b in engine.compile_status()}
    one, wide = status[(1, 1, False)], status[(4, 16, False)]
    assert list(one["alone_ms"]) == [1] and list(one["served_ms"]) == [1] and one["timed_alone"]
    assert list(wide["alone_ms"]) == [2, 3, 4, 6, 8, 12, 16] and set(wide["served_ms"]) <= set(wide["alone_ms"])


@pytest.mark.compile
def test_engine_requests_complete_when_every_graph_raises(model):
    """Graphs that raise on replay: each is dropped once (counted), its step reruns eagerly, and
    the requests complete with the eager tokens."""
    modes = ["off", "auto", LookaheadParams(3, 2, 2, lookup=4)]
    eager = _serve(Engine(model, EngineConfig(**ENGINE)), PROMPTS, modes)
    engine = Engine(model, EngineConfig(**ENGINE, compile="on", compile_buckets=[(1, 1), (4, 16)], compile_kv=[64]))

    def broken(*args):
        raise RuntimeError("graph replay failed")

    for st in engine.compiled._staging.values():
        st.graph = broken
    assert _serve(engine, PROMPTS, modes) == eager
    # then one plain request alone: its one-token steps reach the batch-1 graph whatever widths the
    # batched requests' steps took (the three prompts are admitted in one step, so none ran alone)
    assert _serve(engine, PROMPTS[:1], modes[:1]) == {0: eager[0]}
    assert engine.compiled.graph_failures == 3 and not engine.compiled.ready  # two decode graphs, the prefill graph
    assert engine.runner.eager_forwards > 2 and engine.compiled.calls == 0


@pytest.mark.compile
def test_engine_compile_auto_serves_while_compiling(model, tmp_path, monkeypatch):
    """"auto" returns at once: the first requests run eagerly while the bucket compiles on a
    background thread, and run compiled once it is ready, with the same tokens throughout."""
    eager = _serve(Engine(model, EngineConfig(**ENGINE)), PROMPTS[:1], ["off"])
    # an empty package store: a graph another test stored would load before the first request
    monkeypatch.setattr(compiled_forward, "PackageStore", lambda: PackageStore(tmp_path))
    engine = Engine(model, EngineConfig(**ENGINE, compile="auto", compile_buckets=[(1, 2)], compile_kv=[32],
                                        compile_prefill=False))
    assert engine.compile_status()[0]["ready"] is False  # the compile has just started
    assert _serve(engine, PROMPTS[:1], ["off"]) == eager
    assert engine.runner.eager_forwards > 0
    assert engine.compiled.wait(timeout=600)
    (bucket,) = engine.compile_status()
    assert bucket["ready"] and bucket["compile_s"] > 0 and "error" not in bucket
    before = bucket["calls"]
    assert _serve(engine, PROMPTS[:1], ["off"]) == eager
    assert engine.compile_status()[0]["calls"] > before
    costs = engine.runner.costs  # every forward was (1, 1); the eager ones no longer price it
    assert 0 < costs.samples(1, 1) < costs.observed


@pytest.mark.parametrize("buckets, error", [
    ([(5, 1)], "batch 5 is outside"),
    ([(1, 999)], "width 999 is outside"),
    ([], "compile_buckets is empty"),
])
def test_compile_buckets_outside_the_engine_are_refused(buckets, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig(**ENGINE, compile="auto", compile_buckets=buckets)


@pytest.mark.compile
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph buckets need a CUDA GPU")
def test_engine_cuda_graph_buckets_give_eager_tokens():
    """On CUDA the buckets are CUDA graphs (reduce-overhead, static buffers): the same tokens as
    the eager engine, replayed across requests."""
    model = build_random_model("llama", vocab_size=256).cuda()
    modes = ["off", "auto", LookaheadParams(3, 2, 2, lookup=4)]
    eager = _serve(Engine(model, EngineConfig(**ENGINE)), PROMPTS, modes)
    engine = Engine(model, EngineConfig(**ENGINE, compile="on", compile_buckets=[(1, 1), (4, 16)], compile_kv=[64]))
    assert engine.compiled.cudagraphs and not engine.compiled.freezing
    for _ in range(2):
        assert _serve(engine, PROMPTS, modes) == eager
    assert all(b["ready"] and b["calls"] > 1 for b in engine.compile_status())


def _progress_while_busy(share: float, seconds: float = 1.2) -> tuple[int, int]:
    """Calls a throttled Python thread makes while an 'engine' steps every 2 ms, then once idle."""
    owner = SimpleNamespace(busy=True, beat=0)
    counts, done = [0, 0], threading.Event()

    def work():
        sys.settrace(CompileThrottle(owner, share))
        while not done.is_set():
            _noop()  # a Python call: where the throttle may pause this thread
            counts[0 if owner.busy else 1] += 1

    def _noop():
        return None

    t = threading.Thread(target=work, daemon=True)
    t.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        owner.beat += 1
        time.sleep(0.002)
    busy_calls = counts[0]
    owner.busy = False  # idle: the thread runs freely
    time.sleep(0.3)
    done.set()
    t.join(5)
    return busy_calls, counts[1]


def test_the_throttle_traces_a_compile_only_where_the_engine_had_requests_when_it_started():
    """Tracing costs a compile a Python call per call, busy or not: a graph started while the
    engine is idle runs untraced, one started while it has requests is paced."""
    owner, seen = SimpleNamespace(busy=False, beat=0), []
    throttle = CompileThrottle(owner, 0.25)

    def work():
        for busy in (False, True, False):
            owner.busy = busy
            throttle.attach()
            seen.append(sys.gettrace())
        sys.settrace(None)

    t = threading.Thread(target=work)
    t.start()
    t.join(5)
    assert seen == [None, throttle, None] and sys.gettrace() is not throttle


def test_background_compile_takes_its_share_while_the_engine_steps():
    """With share 0 a compile thread makes no progress while the engine has requests; with a share
    it keeps going (a replica that is never idle still gets compiled) but in turns."""
    waiting, idle = _progress_while_busy(0.0)
    assert waiting == 0 and idle > 0
    shared, idle = _progress_while_busy(0.25)
    assert shared > 0 and idle > 0
    # 1.2 s busy at a quarter share against 0.3 s free: about equal work (unthrottled: 4x)
    assert 0.3 < shared / idle < 2.5, (shared, idle)


def _recorded(cf: CompiledForward) -> list[tuple[str, Bucket, threading.Thread]]:
    """A list that gets ("compile", bucket, thread) at each graph's first call (its compile or load)
    and ("timed", bucket, thread) at each timing alone."""
    events: list[tuple[str, Bucket, threading.Thread]] = []
    run, time_alone = cf._run, cf._time_alone

    def ran(st):
        if st.compile_s is None:
            events.append(("compile", st.bucket, threading.current_thread()))
        return run(st)

    def timed(st, calls=3):
        events.append(("timed", st.bucket, threading.current_thread()))
        return time_alone(st, calls)

    cf._run, cf._time_alone = ran, timed  # type: ignore[method-assign]
    return events


@pytest.mark.compile
def test_stored_graphs_all_load_in_the_background_and_are_timed_on_the_engines_thread(model):
    """A background compile loads every graph whose package is stored (each serves within seconds of
    the start) and times none: the calling thread, the engine's, times each while it has no request
    (`time_pending`), one a call, as its steps run (on the compile thread a two-thread graph ran
    beside the engine thread's OpenMP team and read 2-3x its cost)."""
    buckets = [Bucket(1, 1, 32), Bucket(4, 8, CAP)]
    sizes = {"batch_buckets": (1, 4), "width_buckets": (1, 8), "kv_buckets": (32,), "lazy": False}
    _graphs(model, _prefilled(model), **sizes).warmup(buckets)  # stored (or loaded: stored already)
    cf = _graphs(model, _prefilled(model), **sizes)
    events = _recorded(cf)
    compiler = cf.compile_in_background(buckets)
    assert cf.wait(600)
    assert events == [("compile", b, compiler) for b in buckets] and cf.untimed == buckets
    assert [s["timed_alone"] for s in cf.status()] == [None, None]
    cf.busy = True  # a request came in: nothing is timed beside it
    assert not cf.time_pending() and len(events) == 2
    cf.busy = False
    assert cf.time_pending() and cf.time_pending() and not cf.time_pending()
    assert events[2:] == [("timed", b, threading.current_thread()) for b in buckets]
    assert all(s["ready"] and s["cached"] and s["timed_alone"] for s in cf.status())


@pytest.mark.compile
def test_a_background_compile_waits_for_the_engine_to_time_the_graphs_before_it(model, tmp_path, monkeypatch):
    """Before each compile the compile thread waits while the engine's thread times the graphs
    already ready, so no timing runs beside a compile (it would err slow)."""
    monkeypatch.setattr(compiled_forward, "PackageStore", lambda: PackageStore(tmp_path))  # both compile
    first, second = Bucket(1, 1, 32), Bucket(4, 8, CAP)
    cf = _graphs(model, _prefilled(model), batch_buckets=(1, 4), width_buckets=(1, 8), kv_buckets=(32,), lazy=False)
    events = _recorded(cf)
    compiler = cf.compile_in_background([first, second])
    assert wait_until(lambda: cf.untimed == [first], 600)
    time.sleep(1.0)  # the engine's thread is late: the next compile waits for it
    assert events == [("compile", first, compiler)]
    assert cf.time_pending()
    assert cf.wait(600) and events == [("compile", first, compiler), ("timed", first, threading.current_thread()),
                                       ("compile", second, compiler)]
    assert cf.untimed == [second] and cf.time_pending() and cf.untimed == []


@pytest.mark.compile
def test_an_idle_engine_thread_times_the_graphs_compiled_in_the_background(model):
    """Served ("auto"), the graphs the background compile makes ready are timed on the engine's
    own thread between requests, and /health's `alone_ms` then holds their cost."""
    engine = Engine(model, EngineConfig(**ENGINE, compile="auto", compile_buckets=[(1, 1)], compile_kv=[32],
                                        compile_prefill=False))
    events = _recorded(engine.compiled)
    host = EngineThread(engine)
    host.start(lambda event: None)
    try:
        assert engine.compiled.wait(timeout=600)
        assert wait_until(lambda: engine.compile_status()[0]["timed_alone"] is not None, 30)
    finally:
        host.shutdown()
    (bucket,) = engine.compile_status()
    timings = [thread.name for kind, _, thread in events if kind == "timed"]
    assert timings == ["lookahead-engine"] and bucket["timed_alone"] and bucket["alone_ms"][1] > 0


_LOAD_AND_STEP = """
import sys, torch
from lookahead_core.engine.bucket_staging import Bucket
from lookahead_core.models.random_models import build_random_model
from lookahead_core.engine.compiled_forward import CompiledForward
from tests.lookahead_core.engine.test_compiled_forward import _prefilled, _run, _runner
# nothing before the graph asks Linux for AMX: oneDNN's matmul and SDPA's bf16 kernels would
torch.backends.mkldnn.enabled = False
m = build_random_model("llama", vocab_size=256, dtype=torch.bfloat16, attn_implementation="eager")
cache = _prefilled(m)
cf = CompiledForward(m, cache, batch_buckets=(4,), width_buckets=(1,), kv_buckets=(CAP,), lazy=False)
cf.warmup([Bucket(4, 1, CAP)])
pred, _ = _run(_runner(cf).decode, cache, 4, 1, 5)
print(cf.status()[0]["cached"], cf.calls, pred)
""".replace("CAP", str(CAP))


@pytest.mark.compile
def test_a_bf16_graph_stored_by_one_process_runs_in_a_fresh_one(tmp_path, monkeypatch):
    """A later start only loads its packages: a bf16 graph of four rows (inductor's GEMM template:
    AMX kernels where the CPU has AMX, which a process must ask Linux for before its first tile
    instruction) compiled here runs in a process that loads it and compiles nothing, with this
    process's tokens."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    m = build_random_model("llama", vocab_size=256, dtype=torch.bfloat16, attn_implementation="eager")
    cache = _prefilled(m)
    cf = CompiledForward(m, cache, batch_buckets=(4,), width_buckets=(1,), kv_buckets=(CAP,), lazy=False)
    cf.warmup([Bucket(4, 1, CAP)])
    pred, _ = _run(_runner(cf).decode, cache, 4, 1, 5)
    assert cf.status()[0]["cached"] is False and cf.calls == 1
    child = subprocess.run([sys.executable, "-c", _LOAD_AND_STEP], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert child.stdout.split("\n")[-2] == f"True 1 {pred}"


@pytest.mark.compile
def test_a_later_instance_loads_its_graph_from_the_disk_cache_and_other_weights_do_not(model, tmp_path, monkeypatch):
    """The frozen graph (its weights packed) is kept on disk as a package: a later instance over
    the same weights loads it, and gives the eager tokens; a model of the same shapes with other
    weights never shares it (the package holds packed copies of the weights) and compiles its own;
    a package that does not load (its library gone) is compiled again, and replaced; nothing is
    left behind in temporary folders."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # where a loader would unpack an archive
    same = build_random_model("llama", vocab_size=256)
    same.load_state_dict(model.state_dict())
    other = build_random_model("llama", vocab_size=256, seed=2)
    packages = tmp_path / "lookahead_packages"
    for m, cached, tear in ((model, False, False), (same, True, False), (other, False, False), (same, False, True)):
        if tear:
            [torn] = packages.glob(f"*-{weights_tag(same)[:12]}-*")
            [library] = torn.rglob("*.so")
            library.unlink()
        eager_cache, cache = _prefilled(m), _prefilled(m)
        cf = _graphs(m, cache, batch_buckets=(1,), width_buckets=(1,), kv_buckets=(32,), lazy=False)
        runner = _runner(cf)
        cf.warmup([Bucket(1, 1, 32)])
        [status] = cf.status()
        assert status["ready"] and status["cached"] is cached, status
        ref_pred, ref_logits = _run(_eager(cf.model), eager_cache, 1, 1, 5)
        pred, logits = _run(runner.decode, cache, 1, 1, 5)
        assert cf.calls == 1
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        assert pred == ref_pred
    assert [p.is_dir() for p in packages.iterdir()] == [True, True] and library.exists()  # one per weights, the torn one replaced
    assert not list((tmp_path / "tmp").glob("aotinductor_*"))  # loaded in place, not unpacked (the last still loaded)

from lookahead_core import LookaheadParams
from lookahead_core.engine.scheduler import Scheduler
from lookahead_core.engine.sequence import Sequence, Status
from lookahead_core.lookahead.layout import StepLayout
from lookahead_core.lookahead.stopping import StopCondition


def _seq(i, n_prompt):
    return Sequence(i, list(range(1, n_prompt + 1)), None, StopCondition.build(4, None), lambda p: StepLayout(p, __import__("torch").float32, "cpu"))


def test_prefill_in_chunks_then_running():
    s = Scheduler(max_batch=2, prefill_chunk=4)
    a = _seq("a", 10)  # 9 tokens to prefill: 4 + 4 + 1
    s.add(a)
    assert s.next_prefill() == (a, 0, 4)
    assert s.prefill_done(4) is None
    assert s.next_prefill() == (a, 4, 4)
    s.prefill_done(4)
    assert s.next_prefill() == (a, 8, 1)
    assert s.prefill_done(1) is a
    assert s.running == [a] and a.status is Status.RUNNING and s.prefilling is None


def test_one_token_prompt_needs_no_prefill_forward():
    s = Scheduler(max_batch=2, prefill_chunk=4)
    a = _seq("a", 1)
    s.add(a)
    assert s.next_prefill() == (a, 0, 0)
    assert s.prefill_done(0) is a


def test_fifo_and_slot_limit():
    s = Scheduler(max_batch=1, prefill_chunk=8)
    a, b = _seq("a", 2), _seq("b", 2)
    s.add(a)
    s.add(b)
    job = s.next_prefill()
    assert job[0] is a
    s.prefill_done(job[2])
    assert s.next_prefill() is None  # no free slot for b
    assert len(s) == 2
    s.running.clear()
    assert s.next_prefill()[0] is b


def test_remove_waiting():
    s = Scheduler(max_batch=1, prefill_chunk=8)
    a = _seq("a", 2)
    s.add(a)
    assert s.remove_waiting(a) and not s.remove_waiting(a)


def test_sequence_params_change_rebuilds_lookahead_state():
    seq = _seq("a", 6)
    assert seq.params is None and seq.layout.max_tokens == 1
    seq.set_params(LookaheadParams(3, 2, 2))
    assert seq.layout.max_tokens == 1 + 4 + 4 + 8 and seq.window.levels and seq.pool.lookup(1) == [(2, 3)]
    seq.set_params(None)
    assert seq.layout.max_tokens == 1

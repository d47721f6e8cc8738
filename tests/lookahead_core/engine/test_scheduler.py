import torch

from lookahead_core import LookaheadParams
from lookahead_core.engine.scheduler import Scheduler, SlotMove
from lookahead_core.engine.sequence import Sequence
from lookahead_core.lookahead.layout import StepLayout
from lookahead_core.lookahead.stopping import FinishReason
from tests.lookahead_core.helpers import req


def _seq(i, n_prompt, params=None):
    return Sequence.of(req(i, range(1, n_prompt + 1), 4, params), params, lambda p: StepLayout(p, torch.float32, "cpu"))


def test_prefill_in_chunks_then_running():
    s = Scheduler(max_batch=2, prefill_chunk=4)
    a = _seq("a", 9)  # 9 tokens to prefill (the last one gives the first new token): 4 + 4 + 1
    s.add(a)
    assert s.next_prefill() == (a, 0, 4) and a.slot == 0
    assert s.prefill_done(4) is None
    assert s.next_prefill() == (a, 4, 4)
    s.prefill_done(4)
    assert s.next_prefill() == (a, 8, 1)
    assert s.prefill_done(1) is a
    assert s.running == [a] and s.prefilling is None


def test_a_one_token_prompt_prefills_its_token():
    s = Scheduler(max_batch=2, prefill_chunk=4)
    a = _seq("a", 1)
    s.add(a)
    assert s.next_prefill() == (a, 0, 1)
    assert s.prefill_done(1) is a


def test_fifo_and_slot_limit():
    s = Scheduler(max_batch=1, prefill_chunk=8)
    a, b = _seq("a", 2), _seq("b", 2)
    s.add(a)
    s.add(b)
    job = s.next_prefill()
    assert job[0] is a
    s.prefill_done(job[2])
    assert s.next_prefill() is None  # no free slot for b
    assert len(s) == 2 and s.free_slots() == 0
    a.finish_reason = FinishReason.LENGTH
    assert s.retire() == ([a], [SlotMove(0)])
    assert s.next_prefill()[0] is b and b.slot == 0


def test_retire_fills_holes_from_the_end_and_moves_the_prefilling_slot():
    s = Scheduler(max_batch=4, prefill_chunk=8)
    seqs = [_seq(i, 2) for i in range(4)]
    for seq in seqs:
        s.add(seq)
    for _ in range(3):
        s.prefill_done(s.next_prefill()[2])
    s.next_prefill()  # the fourth holds slot 3, prefilling
    seqs[0].finish_reason = FinishReason.EOS
    done, moves = s.retire()
    assert done == [seqs[0]] and moves == [SlotMove(0, 2), SlotMove(2, 3)]
    assert [q.slot for q in s.running] == [0, 1] and s.running[0] is seqs[2] and seqs[3].slot == 2


def test_abort_frees_a_waiting_or_prefilling_slot_at_once_and_a_running_one_at_retire():
    s = Scheduler(max_batch=2, prefill_chunk=8)
    a, b, c = _seq("a", 2), _seq("b", 2), _seq("c", 2)
    for seq in (a, b, c):
        s.add(seq)
    s.prefill_done(s.next_prefill()[2])
    s.next_prefill()  # b prefilling in slot 1
    assert s.abort(c) == [] and c.finish_reason is FinishReason.ABORT and c not in s.waiting
    assert s.abort(b) == [SlotMove(1)] and s.prefilling is None
    assert s.abort(a) == [] and s.running == [a]
    assert s.retire() == ([a], [SlotMove(0)])


def test_a_lookahead_sequence_builds_its_window_and_pool_from_the_prompt():
    seq = _seq("a", 6, LookaheadParams(3, 2, 2))
    assert seq.layout.max_tokens == 1 + 4 + 4 + 8 + 32 and seq.drafter.window.levels and seq.drafter.pool.lookup(1) == [(2, 3)]
    assert _seq("b", 6).layout.max_tokens == 1 and _seq("b", 6).drafter is None

import torch

from lookahead_core import LookaheadParams
from lookahead_core.engine.step.scheduler import Scheduler, SlotMove
from lookahead_core.engine.step.sequence import Sequence
from lookahead_core.lookahead.layout import StepLayout
from lookahead_core.lookahead.stopping import FinishReason
from tests.lookahead_core.helpers import req


def _seq(i, n_prompt, params=None):
    return Sequence.of(req(i, range(1, n_prompt + 1), 4, params), params, lambda p: StepLayout(p, torch.float32, "cpu"))


def _jobs(out):
    return [(j.seq, j.start, j.tokens, j.reused, j.last) for j in out.prefill]


def test_prefill_in_chunks_then_running():
    s = Scheduler(max_batch=2, prefill_chunk=4)
    a = _seq("a", 9)  # 9 tokens to prefill (the last one gives the first new token): 4 + 4 + 1
    s.add(a)
    first = s.schedule()
    assert _jobs(first) == [(a, 0, 4, 0, False)] and a.slot == 0 and first.decode == [] and first.behind == 1
    assert _jobs(s.schedule()) == [(a, 4, 4, 0, False)]
    last = s.schedule()
    assert _jobs(last) == [(a, 8, 1, 0, True)] and last.decode == [] and last.behind == 1  # decodes next step
    assert s.running == [a] and s.prefilling is None
    assert s.schedule().decode == [a]


def test_short_prompts_share_one_step_and_a_stored_prefix_is_not_charged():
    s = Scheduler(max_batch=4, prefill_chunk=8)
    a, b, c = _seq("a", 3), _seq("b", 12), _seq("c", 3)
    for seq in (a, b, c):
        s.add(seq)
    out = s.schedule(lambda seq: 6 if seq is b else 0)
    assert _jobs(out) == [(a, 0, 3, 0, True), (b, 6, 5, 6, False)] and b.slot == 1
    assert s.running == [a] and s.prefilling is b
    assert _jobs(s.schedule()) == [(b, 11, 1, 0, True), (c, 0, 3, 0, True)] and [q.slot for q in s.running] == [0, 1, 2]


def test_a_one_token_prompt_prefills_its_token():
    s = Scheduler(max_batch=2, prefill_chunk=4)
    a = _seq("a", 1)
    s.add(a)
    assert _jobs(s.schedule()) == [(a, 0, 1, 0, True)]


def test_fifo_and_slot_limit():
    s = Scheduler(max_batch=1, prefill_chunk=8)
    a, b = _seq("a", 2), _seq("b", 2)
    s.add(a)
    s.add(b)
    assert _jobs(s.schedule()) == [(a, 0, 2, 0, True)]
    out = s.schedule()
    assert out.prefill == [] and out.decode == [a] and out.behind == 1  # no free slot for b
    assert len(s) == 2 and s.free_slots() == 0
    a.finish_reason = FinishReason.LENGTH
    out = s.schedule()
    assert out.retired == [a] and out.moves == [SlotMove(0)] and _jobs(out)[0][0] is b and b.slot == 0


def test_retire_fills_holes_from_the_end_and_moves_the_prefilling_slot():
    s = Scheduler(max_batch=4, prefill_chunk=8)
    seqs = [_seq(i, 4 if i < 3 else 6) for i in range(4)]
    for seq in seqs:
        s.add(seq)
    s.schedule()  # 4 + 4 tokens: the first two run
    s.schedule()  # the third runs; the fourth holds slot 3, prefilling
    assert s.prefilling is seqs[3] and seqs[3].slot == 3
    seqs[0].finish_reason = FinishReason.EOS
    done, moves = s.retire()
    assert done == [seqs[0]] and moves == [SlotMove(0, 2), SlotMove(2, 3)]
    assert [q.slot for q in s.running] == [0, 1] and s.running[0] is seqs[2] and seqs[3].slot == 2


def test_abort_frees_a_waiting_or_prefilling_slot_at_once_and_a_running_one_at_retire():
    s = Scheduler(max_batch=2, prefill_chunk=3)
    a, b, c = _seq("a", 2), _seq("b", 2), _seq("c", 2)
    for seq in (a, b, c):
        s.add(seq)
    s.schedule()  # a runs, b prefilling in slot 1
    assert s.prefilling is b and b.slot == 1
    assert s.abort(c) == [] and c.finish_reason is FinishReason.ABORT and c not in s.waiting
    assert s.abort(b) == [SlotMove(1)] and s.prefilling is None
    assert s.abort(a) == [] and s.running == [a]
    assert s.retire() == ([a], [SlotMove(0)])


def test_a_lookahead_sequence_builds_its_window_and_pool_from_the_prompt():
    seq = _seq("a", 6, LookaheadParams(3, 2, 2))
    assert seq.layout.max_tokens == 1 + 4 + 4 + 8 + 32 and seq.drafter.window.levels and seq.drafter.pool.lookup(1) == [(2, 3)]
    assert _seq("b", 6).layout.max_tokens == 1 and _seq("b", 6).drafter is None


def _choice(group, i, n_prompt, **kwargs):
    seq = Sequence.of(req(f"{group}-{i}", range(1, n_prompt + 1), 4, group=group, **kwargs), None,
                      lambda p: StepLayout(p, torch.float32, "cpu"))
    return seq


def test_a_requests_choices_share_its_prefill_and_hold_at_most_request_slots():
    s = Scheduler(max_batch=4, prefill_chunk=16, request_slots=2)
    big = [_choice("big", i, 10) for i in range(4)]
    for seq in big:
        s.add(seq)
    other = _seq("other", 3)
    s.add(other)
    out = s.schedule()
    # the first choice prefills its prompt; the other request goes before the second choice, which
    # copies the prompt from the first's slot, all but its last token
    assert _jobs(out) == [(big[0], 0, 10, 0, True), (other, 0, 3, 0, True), (big[1], 9, 1, 9, True)]
    assert [j.sibling for j in out.prefill] == [None, None, 0]
    # the request holds its 2 slots: its other choices wait although a slot is free
    assert s.running == [big[0], other, big[1]] and list(s.waiting) == big[2:] and s.free_slots() == 1
    assert s.schedule().prefill == []
    big[0].finish_reason = FinishReason.LENGTH
    out = s.schedule()
    assert [(j.seq, j.reused, j.sibling) for j in out.prefill] == [(big[2], 9, big[1].slot)]


def test_a_new_request_is_admitted_before_another_requests_next_choice():
    s = Scheduler(max_batch=8, prefill_chunk=4, request_slots=8)
    big = [_choice("big", i, 6) for i in range(3)]
    for seq in big:
        s.add(seq)
    s.schedule()  # big-0's first chunk
    late = _seq("late", 2)
    s.add(late)
    out = s.schedule()  # big-0 completes; the late request goes before big-1 and big-2
    assert [j.seq for j in out.prefill] == [big[0], late]
    assert [j.seq for j in s.schedule().prefill] == [big[1], big[2]]


def test_a_choice_that_wants_its_prompt_logprobs_prefills_its_own():
    s = Scheduler(max_batch=4, prefill_chunk=32, request_slots=4)
    a, b = _choice("g", 0, 5), _choice("g", 1, 5, prompt_logprobs=1)
    s.add(a)
    s.add(b)
    assert [(j.seq, j.start, j.reused, j.sibling) for j in s.schedule().prefill] == [(a, 0, 0, None), (b, 0, 0, None)]
    unshared = Scheduler(max_batch=4, prefill_chunk=32, share_prefill=False)
    c, d = _choice("h", 0, 5), _choice("h", 1, 5)
    unshared.add(c)
    unshared.add(d)
    assert [j.reused for j in unshared.schedule().prefill] == [0, 0]

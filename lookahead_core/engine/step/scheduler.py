"""Which sequences run, in which KV slot: admission fair across requests, prompt chunks of at most
`prefill_chunk` tokens per step, finish and retire; one `ScheduleOutput` per step says what the step runs."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from lookahead_core.engine.step.sequence import Sequence
from lookahead_core.lookahead.stopping import FinishReason


@dataclass(frozen=True)
class SlotMove:
    """What the KV cache must do after a scheduling change: move slot `src`'s entries into `dst`
    (src None: `dst` is freed)."""

    dst: int
    src: int | None = None


@dataclass(frozen=True)
class PrefillJob:
    """Prompt tokens [start, start + tokens) of `seq` into its slot, after `reused` tokens are copied
    in (at admission only): from slot `sibling`, a running choice of the same request, or else from
    a stored prefix; `last`: the chunk completes the prompt."""

    seq: Sequence
    slot: int
    start: int
    tokens: int
    reused: int = 0
    last: bool = False
    sibling: int | None = None


@dataclass(frozen=True)
class ScheduleOutput:
    """One step's schedule: the sequences that finished and the slot moves that close their holes
    (applied before anything runs), the prompt chunks to prefill, the sequences that decode, and
    how many requests stand behind them (waiting, prefilling, or just prefilled)."""

    retired: list[Sequence]
    moves: list[SlotMove]
    prefill: list[PrefillJob]
    decode: list[Sequence]
    behind: int


class Scheduler:
    """Owns every sequence's state change and slot.

    Running sequences sit in slots [0, len(running)); the sequence being prefilled holds the next
    slot. A step prefills at most `prefill_chunk` prompt tokens, so an arriving long prompt delays
    the running sequences by a bounded forward per step, never by its whole prefill; short prompts
    share that budget (one after another, each completed starts running).

    Admission is fair across requests: the next admitted is the earliest waiting sequence of the
    requests holding the fewest slots, so a request's second choice waits behind another request's
    first, and a request's choices (its `group`) hold at most `request_slots` slots at once. A
    choice whose request already runs another copies that one's prompt keys and values
    (`share_prefill`), so the prompt is prefilled once per request, not once per choice.
    """

    def __init__(self, max_batch: int, prefill_chunk: int, request_slots: int | None = None,
                 share_prefill: bool = True) -> None:
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.request_slots = max_batch if request_slots is None else request_slots
        self.share_prefill = share_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilling: Sequence | None = None
        self.prefilled = 0  # prompt tokens of `prefilling` already in its slot

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running) + (self.prefilling is not None)

    def free_slots(self) -> int:
        return self.max_batch - len(self.running) - (self.prefilling is not None)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, prefix_match: Callable[[Sequence], int] = lambda seq: 0) -> ScheduleOutput:
        """Retire the finished; then prompt chunks of `prefill_chunk` tokens in all, admitting waiting
        sequences into free slots in order (`prefix_match(seq)`: the prompt tokens a stored prefix
        gives an admitted sequence, not charged to the budget); the sequences running before them
        decode. Short prompts arriving together share one step; a prompt a chunk completes runs
        from the next step's decode. The state changes here, as the step will carry it out."""
        retired, moves = self.retire()
        decode = list(self.running)
        jobs: list[PrefillJob] = []
        budget = self.prefill_chunk
        while budget > 0:
            reused, sibling = 0, None
            if self.prefilling is None:
                seq = self._next_admitted() if len(self.running) < self.max_batch else None
                if seq is None:
                    break
                self.prefilling = seq
                seq.slot = len(self.running)
                twin = self._running_sibling(seq)
                if twin is not None and seq.prompt_len > 1:
                    reused, sibling = seq.prompt_len - 1, twin.slot
                else:
                    reused = prefix_match(seq)
                self.prefilled = reused
                assert 0 <= reused < seq.prompt_len, "a copied prefix never holds a prompt's last token"
            seq = self.prefilling
            assert seq.slot is not None
            start = self.prefilled
            n = min(seq.prompt_len - start, budget)
            self.prefilled += n
            last = self.prefilled == seq.prompt_len
            jobs.append(PrefillJob(seq, seq.slot, start, n, reused, last, sibling))
            budget -= n
            if not last:  # the prompt goes on next step
                break
            self.prefilling = None
            self.running.append(seq)
        behind = len(self.waiting) + (self.prefilling is not None) + len(self.running) - len(decode)
        return ScheduleOutput(retired, moves, jobs, decode, behind)

    def _next_admitted(self) -> Sequence | None:
        """Taken out of `waiting`: the earliest sequence of the requests holding the fewest slots,
        none of a request at `request_slots` (None: nothing can be admitted now)."""
        held: dict[str | int, int] = {}
        for seq in self.running:
            if seq.group is not None:
                held[seq.group] = held.get(seq.group, 0) + 1
        best, fewest = None, self.request_slots
        for seq in self.waiting:
            n = 0 if seq.group is None else held.get(seq.group, 0)
            if n < fewest:
                best, fewest = seq, n
                if n == 0:
                    break
        if best is not None:
            self.waiting.remove(best)
        return best

    def _running_sibling(self, seq: Sequence) -> Sequence | None:
        """A running choice of `seq`'s request (the same prompt, its keys and values in its slot),
        where `seq` may copy them: not where it wants its prompt's logprobs (copied keys have no logits)."""
        if seq.group is None or not self.share_prefill or seq.prompt_logprobs is not None:
            return None
        for other in self.running:
            if other.group == seq.group and other.prompt_len == seq.prompt_len:
                return other
        return None

    def abort(self, seq: Sequence, reason: FinishReason = FinishReason.ABORT) -> list[SlotMove]:
        """End `seq` from outside the step (as ABORT, or as the caller's `reason`). A waiting or
        prefilling sequence leaves at once (its slot freed); a running one keeps its slot until the
        next `retire`."""
        seq.finish_reason = reason
        if seq in self.waiting:
            self.waiting.remove(seq)
            return []
        if seq is self.prefilling:
            assert seq.slot is not None, "the prefilling sequence holds a slot"
            self.prefilling = None
            return [SlotMove(seq.slot)]
        return []

    def abort_all(self) -> list[Sequence]:
        """End every sequence as ABORT; returns them (every slot is then free)."""
        seqs = [*self.waiting, *self.running, *([self.prefilling] if self.prefilling else [])]
        for seq in seqs:
            seq.finish_reason = FinishReason.ABORT
        self.waiting.clear()
        self.running.clear()
        self.prefilling = None
        return seqs

    def retire(self) -> tuple[list[Sequence], list[SlotMove]]:
        """Take finished sequences out of the running slots, keeping running ones in [0, running):
        the last running sequence moves into each hole, and the prefilling one follows."""
        running = self.running
        before = len(running)
        done, moves = [], []
        for b in range(before - 1, -1, -1):
            if not running[b].finished:
                continue
            done.append(running[b])
            last = len(running) - 1
            if b != last:
                running[b] = running[last]
                running[b].slot = b
                moves.append(SlotMove(b, last))
            else:
                moves.append(SlotMove(b))
            running.pop()
        if self.prefilling is not None and len(running) != before:
            moves.append(SlotMove(len(running), self.prefilling.slot))
            self.prefilling.slot = len(running)
        return done, moves

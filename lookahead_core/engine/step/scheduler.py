"""Which sequences run, in which KV slot: FIFO admission, prompt chunks of at most `prefill_chunk`
tokens per step, finish and retire; one `ScheduleOutput` per step says what the step runs."""
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
    """Prompt tokens [start, start + tokens) of `seq` into its slot, after the `reused` tokens of a
    stored prefix are copied in (at admission only); `last`: the chunk completes the prompt."""

    seq: Sequence
    slot: int
    start: int
    tokens: int
    reused: int = 0
    last: bool = False


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
    """

    def __init__(self, max_batch: int, prefill_chunk: int) -> None:
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
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
            reused = 0
            if self.prefilling is None:
                if not self.waiting or len(self.running) >= self.max_batch:
                    break
                self.prefilling = seq = self.waiting.popleft()
                seq.slot = len(self.running)
                self.prefilled = reused = prefix_match(seq)
                assert 0 <= reused < seq.prompt_len, "a stored prefix never holds a prompt's last token"
            seq = self.prefilling
            assert seq.slot is not None
            start = self.prefilled
            n = min(seq.prompt_len - start, budget)
            self.prefilled += n
            last = self.prefilled == seq.prompt_len
            jobs.append(PrefillJob(seq, seq.slot, start, n, reused, last))
            budget -= n
            if not last:  # the prompt goes on next step
                break
            self.prefilling = None
            self.running.append(seq)
        behind = len(self.waiting) + (self.prefilling is not None) + len(self.running) - len(decode)
        return ScheduleOutput(retired, moves, jobs, decode, behind)

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

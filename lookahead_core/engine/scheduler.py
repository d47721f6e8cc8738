"""Which sequences run, in which KV slot: FIFO admission, prompt chunks of at most `prefill_chunk`
tokens per step, finish and retire."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from lookahead_core.engine.sequence import Sequence
from lookahead_core.lookahead.stopping import FinishReason


@dataclass(frozen=True)
class SlotMove:
    """What the KV cache must do after a scheduling change: move slot `src`'s entries into `dst`
    (src None: `dst` is freed)."""

    dst: int
    src: int | None = None


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

    def next_prefill(self, budget: int | None = None) -> tuple[Sequence, int, int] | None:
        """(sequence, start, tokens) of the next prefill chunk, of at most `budget` tokens (default:
        `prefill_chunk`), admitting a waiting sequence into the next slot if one is free."""
        if self.prefilling is None:
            if not self.waiting or len(self.running) >= self.max_batch:
                return None
            self.prefilling = seq = self.waiting.popleft()
            seq.slot = len(self.running)
            self.prefilled = 0
        seq = self.prefilling
        remaining = seq.prompt_len - self.prefilled
        return seq, self.prefilled, min(remaining, self.prefill_chunk if budget is None else budget)

    def prefill_done(self, tokens: int) -> Sequence | None:
        """Record a prefill chunk; returns the sequence when its prompt is in and it starts running."""
        self.prefilled += tokens
        seq = self.prefilling
        if seq is None or self.prefilled < seq.prompt_len:
            return None
        self.prefilling = None
        self.running.append(seq)
        return seq

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

"""Which sequences run this step: FIFO admission into free slots, one prefill chunk per step."""
from __future__ import annotations

from collections import deque

from lookahead_core.engine.sequence import Sequence, Status


class Scheduler:
    """Running sequences sit in slots [0, len(running)); the sequence being prefilled holds the next slot.

    A step does at most one prefill chunk of `prefill_chunk` tokens, so an arriving long prompt
    delays the running sequences by one bounded forward per step, never by its whole prefill.
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

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def next_prefill(self) -> tuple[Sequence, int, int] | None:
        """(sequence, start, tokens) of the next prefill chunk, admitting a waiting sequence if a slot is free."""
        if self.prefilling is None:
            if not self.waiting or len(self.running) >= self.max_batch:
                return None
            self.prefilling = self.waiting.popleft()
            self.prefilled = 0
        seq = self.prefilling
        remaining = seq.prompt_len - 1 - self.prefilled
        return seq, self.prefilled, min(remaining, self.prefill_chunk)

    def prefill_done(self, tokens: int) -> Sequence | None:
        """Record a prefill chunk; returns the sequence when its prompt is in and it starts running."""
        self.prefilled += tokens
        seq = self.prefilling
        if seq is None or self.prefilled < seq.prompt_len - 1:
            return None
        self.prefilling = None
        seq.status = Status.RUNNING
        self.running.append(seq)
        return seq

    def remove_waiting(self, seq: Sequence) -> bool:
        try:
            self.waiting.remove(seq)
            return True
        except ValueError:
            return False

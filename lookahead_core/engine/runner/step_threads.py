"""How many torch threads a forward runs on, by the number of sequences it decodes, or a prompt chunk's."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepThreads:
    """`threads` for a decode forward of fewer than `large_batch` sequences, `large_threads` from
    there up and for a prompt chunk (as long a forward as a large batch's, or longer). A compiled
    graph is compiled for the threads its forwards run on. Set by the core plan."""

    threads: int
    large_batch: int | None = None
    large_threads: int | None = None
    compile_cores: frozenset[int] | None = None  # where the engine's thread is bound to fewer: a background compile's

    def for_batch(self, rows: int, prefill: bool = False) -> int:
        if self.large_batch is not None and self.large_threads is not None and (prefill or rows >= self.large_batch):
            return self.large_threads
        return self.threads

    def use(self, rows: int, prefill: bool = False) -> None:
        """This thread's torch threads for a forward of `rows` sequences, or of a prompt chunk (a
        no-op when unchanged)."""
        n = self.for_batch(rows, prefill)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

"""The shapes a compiled graph takes, and which ready graph runs a step."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# The step widths a ready decode graph is timed at alone, for the planner's prices
# (`StepCosts.calibrate`); widths between are interpolated, wider ones extrapolated.
TIMED_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# The most rows (batch x width) a timing alone runs: the planner does not widen large batches
TIMED_ROWS = 256


@dataclass(frozen=True)
class Bucket:
    """A graph's shape: at most `batch` rows of `width` tokens attending to `kv` keys. A dynamic
    bucket (CPU) takes any batch, width and key count up to its own in one graph; a static one
    (CUDA graphs) pads every step to its shape. A *prefill* bucket runs a prompt chunk of any one
    slot (its keys gathered) and returns the chunk's last row only."""

    batch: int
    width: int
    kv: int
    prefill: bool = False
    dynamic: bool = True

    def __str__(self) -> str:
        kind = "prefill" if self.prefill else "decode"
        return f"{kind} ({self.batch}, {self.width}, kv {self.kv}){'' if self.dynamic else ' static'}"

    @property
    def slug(self) -> str:
        return f"{'prefill' if self.prefill else 'decode'}-{self.batch}x{self.width}x{self.kv}"

    def holds(self, rows: int, width: int, kv_len: int) -> bool:
        return rows <= self.batch and width <= self.width and kv_len <= self.kv

    def run_shape(self, rows: int, width: int) -> tuple[int, int]:
        """The (batch, width) a step of `rows` x `width` runs at in this bucket's graph."""
        return (rows, width) if self.dynamic else (self.batch, self.width)

    def timed_cells(self) -> list[tuple[int, int]]:
        """The (batch, width) cells its graph is timed at alone: powers of two of the batch up to
        its own by TIMED_WIDTHS it holds, TIMED_ROWS rows at most (a static graph: its own shape)."""
        if self.prefill:
            return [(1, min(32, self.width))]
        if not self.dynamic:
            return [(self.batch, self.width)]
        return [(b, w) for b in powers_of_two(self.batch) for w in TIMED_WIDTHS
                if w <= self.width and (b * w <= TIMED_ROWS or w == 1)]


def powers_of_two(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `limit`, then `limit`."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return tuple(out)


def cheapest(ready: Iterable[Bucket], rows: int, width: int, kv_len: int, prefill: bool = False) -> Bucket | None:
    """The ready bucket that holds a step at the fewest padded rows x width x keys (a dynamic one
    pads nothing), or None: the step runs eagerly."""
    held = [b for b in ready if b.prefill == prefill and b.holds(rows, width, kv_len)]
    return min(held, key=lambda b: (b.batch * b.width * b.kv if not b.dynamic else rows * width * kv_len,
                                    not b.dynamic, b.batch, b.width), default=None)

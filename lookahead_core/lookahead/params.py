"""Per-request lookahead settings."""
from __future__ import annotations

from dataclasses import dataclass


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"lookahead {name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"lookahead {name} must be >= {low}, got {value}")


@dataclass(frozen=True)
class LookaheadParams:
    """(N, W, G) of Lookahead Decoding.

    n: N-gram size (window levels = n - 1; a verified candidate carries n - 1 tokens).
    w: window width, future positions decoded in parallel by the lookahead branch.
    g: verification candidates per step, and the pool's cap per key.
    pool_from_prompt: also harvest n-grams from the prompt and the accepted output.
    """

    # Defaults: the best setting on chat text with the default model in bf16 on the 2-core CPU
    # (docs/BENCHMARKS.md); wider windows pay off where extra tokens per step are nearly free (GPUs).
    n: int = 3
    w: int = 2
    g: int = 2
    pool_from_prompt: bool = True

    def __post_init__(self) -> None:
        _check_int("n", self.n, 2)
        _check_int("w", self.w, 1)
        _check_int("g", self.g, 0)
        if not isinstance(self.pool_from_prompt, bool):
            raise ValueError(f"lookahead pool_from_prompt must be a bool, got {self.pool_from_prompt!r}")

    @classmethod
    def parse(cls, text: str) -> LookaheadParams:
        """ "4,3,3" -> LookaheadParams(4, 3, 3), with a clear message for anything else."""
        parts = text.strip().strip("()").split(",")
        try:
            n, w, g = (int(x) for x in parts)
        except ValueError:
            raise ValueError(f"lookahead setting must be three integers N,W,G, got {text!r}") from None
        return cls(n, w, g)

    @property
    def window_tokens(self) -> int:
        return (self.n - 1) * self.w

    @property
    def max_step_tokens(self) -> int:
        """Tokens in one forward: last token, window, and g candidates of n - 1 tokens."""
        return 1 + self.window_tokens + self.g * (self.n - 1)

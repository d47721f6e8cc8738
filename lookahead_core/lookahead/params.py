"""Per-request lookahead settings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


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
    lookup: longest candidate copied from the request's own text after an earlier occurrence of
        its last `lookup_match` tokens (prompt lookup); 0 turns it off.
    successors: candidate tree rows expanded from the last token through the replica's table of
        the model's top-k successors of each token (`SuccessorTable`); 0 turns it off.
    adapt: let the request narrow a step (no window, or plain) while the wider step's measured
        cost exceeds the tokens it has been yielding (`StepPacer`); False runs every step whole.
    """

    # Defaults: the best setting on chat text with the default model in bf16 on the 2-core CPU
    # (docs/BENCHMARKS.md); wider windows pay off where extra tokens per step are nearly free (GPUs).
    n: int = 3
    w: int = 2
    g: int = 2
    pool_from_prompt: bool = True
    lookup: int = 8
    lookup_match: int = 2
    successors: int = 32  # an upper bound: each step keeps the nodes worth a row at the measured price
    adapt: bool = True

    MINIMUM: ClassVar[dict[str, int]] = {"n": 2, "w": 1, "g": 0, "lookup": 0, "lookup_match": 1, "successors": 0}

    def __post_init__(self) -> None:
        for name, low in self.MINIMUM.items():
            _check_int(name, getattr(self, name), low)
        for name in ("pool_from_prompt", "adapt"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"lookahead {name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def parse(cls, text: str) -> LookaheadParams:
        """ "4,3,3" -> LookaheadParams(4, 3, 3); "4,3,3,0" also sets `lookup` and "4,3,3,8,16"
        `successors`; a trailing "fixed" ("4,3,3 fixed") turns `adapt` off."""
        body = text.strip()
        adapt = not body.endswith("fixed")
        body = body.removesuffix("fixed").strip()
        parts = body.strip("()").split(",")
        try:
            values = [int(x) for x in parts]
        except ValueError:
            values = []
        if not 3 <= len(values) <= 5:
            raise ValueError(f"lookahead setting must be three integers N,W,G (and optionally LOOKUP and SUCCESSORS), "
                             f"got {text!r}")
        n, w, g = values[:3]
        lookup = values[3] if len(values) > 3 else cls.lookup
        successors = values[4] if len(values) > 4 else cls.successors
        return cls(n, w, g, lookup=lookup, successors=successors, adapt=adapt)

    @property
    def label(self) -> str:
        values = [self.n, self.w, self.g]
        if (self.lookup, self.successors) != (LookaheadParams.lookup, LookaheadParams.successors):
            values.append(self.lookup)
        if self.successors != LookaheadParams.successors:
            values.append(self.successors)
        base = ",".join(map(str, values))
        return f"({base})" if self.adapt else f"({base}) fixed"

    @property
    def window_tokens(self) -> int:
        return (self.n - 1) * self.w

    @property
    def max_candidate_tokens(self) -> int:
        """Verification rows: g pooled candidates of n - 1 tokens, one prompt-lookup candidate and
        the successor tree."""
        return self.g * (self.n - 1) + self.lookup + self.successors

    @property
    def max_step_tokens(self) -> int:
        """Tokens in one forward: last token, window and verification rows."""
        return 1 + self.window_tokens + self.max_candidate_tokens

"""vLLM's logits options for one request: penalties, logit bias and a floor on new tokens, as a value.
How they change a row of logits along a tree path lives in `shaping.py`."""
from __future__ import annotations

from dataclasses import dataclass

# the bounds vLLM and OpenAI state for each option
MAX_PENALTY = 2.0  # presence and frequency: [-2, 2]
MAX_REPETITION_PENALTY = 100.0
MAX_BIAS = 100.0  # logit_bias values: [-100, 100]
MAX_BIASED_TOKENS = 1024
MAX_MIN_TOKENS = 1 << 20


def _number(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LogitRules:
    """repetition_penalty: HF's, over the prompt's and the output's tokens (a logit above 0 divided
    by it, below 0 multiplied). presence_penalty / frequency_penalty: OpenAI's, over the output's
    tokens (minus presence once a token appeared, minus frequency per appearance). logit_bias:
    (token, bias) pairs added to the logits. min_tokens: the end tokens (EOS and `stop_token_ids`)
    cannot be produced before this many new tokens. Each is neutral at its default."""

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        _number("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, lo_open=True)
        _number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        bias = self.logit_bias
        pairs = tuple(sorted(bias.items())) if isinstance(bias, dict) else tuple(tuple(p) for p in bias)
        if len(pairs) > MAX_BIASED_TOKENS:
            raise ValueError(f"logit_bias may name at most {MAX_BIASED_TOKENS} tokens, got {len(pairs)}")
        for pair in pairs:
            if len(pair) != 2 or isinstance(pair[0], bool) or not isinstance(pair[0], int) or pair[0] < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {pair[0]!r}")
            _number(f"logit_bias[{pair[0]}]", pair[1], -MAX_BIAS, MAX_BIAS)
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError("logit_bias names a token twice")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in pairs))
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= MAX_MIN_TOKENS:
            raise ValueError(f"min_tokens must be an integer in [0, {MAX_MIN_TOKENS}], got {m!r}")

    @property
    def active(self) -> bool:
        """Whether any option changes a logit."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                    or self.logit_bias or self.min_tokens)

    @property
    def max_token(self) -> int:
        """The largest token id named (the engine checks it against its vocabulary), -1 if none."""
        return max((t for t, _ in self.logit_bias), default=-1)

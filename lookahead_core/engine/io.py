"""What crosses the engine's edge: the one request type it takes (built once above it, checked once
here), the step outputs it returns, a request's figures and token log-probabilities."""
from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Literal

import torch

from lookahead_core.constraints.grammar import GrammarSpec
from lookahead_core.constraints.logit_rules import LogitRules
from lookahead_core.lookahead.pacing import StepKind
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams
from lookahead_core.lookahead.stopping import FinishReason, StopCondition
from lookahead_core.lookahead.tree import SOURCE_NAMES

Lookahead = LookaheadParams | Literal["auto", "off"]


def check_lookahead(value: object) -> None:
    if not (isinstance(value, LookaheadParams) or value in ("auto", "off")):
        raise ValueError(f"`lookahead` must be \"auto\", \"off\" or LookaheadParams, got {value!r}")


def check_sampling(value: object) -> None:
    if value is not None and not isinstance(value, SamplingParams):
        raise ValueError(f"`sampling` must be SamplingParams or None, got {type(value).__name__}")


@dataclass(frozen=True)
class EngineRequest:
    """One sequence to decode.

    lookahead: fixed (N, W, G), "off" (plain decoding) or "auto" (the engine's own setting, paced).
    sampling: None or temperature 0 is greedy. logprobs / prompt_logprobs: report each new / prompt
    token's log-probability with that many most likely alternatives (None: not at all). group: the
    served request this is one choice of (its `n` choices share one prompt): choices of one group
    share its prefill and hold at most the engine's `request_slots` slots at once. rules: penalties,
    logit bias, min_tokens (None: none). grammar: what the output must match (None: anything).
    """

    request_id: str | int
    prompt: tuple[int, ...]
    stop: StopCondition
    lookahead: Lookahead = "auto"
    sampling: SamplingParams | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    group: str | int | None = None
    rules: LogitRules | None = None
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        prompt = self.prompt
        if isinstance(prompt, (str, bytes)) or any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise ValueError("the prompt must be a sequence of token ids")
        object.__setattr__(self, "prompt", tuple(int(t) for t in prompt))
        if not self.prompt:
            raise ValueError("the prompt must hold at least one token")
        if not isinstance(self.stop, StopCondition):
            raise TypeError(f"stop must be a StopCondition, got {type(self.stop).__name__}")
        check_lookahead(self.lookahead)
        check_sampling(self.sampling)
        check_top("logprobs", self.logprobs)
        check_top("prompt_logprobs", self.prompt_logprobs)
        if self.rules is not None and not isinstance(self.rules, LogitRules):
            raise TypeError(f"rules must be LogitRules or None, got {type(self.rules).__name__}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise TypeError(f"grammar must be a GrammarSpec or None, got {type(self.grammar).__name__}")

    @property
    def max_new_tokens(self) -> int:
        return self.stop.max_new_tokens


@dataclass
class SequenceStats:
    """What one request ran: steps of each kind, rows fed to the model and tokens accepted."""

    prompt_tokens: int
    new_tokens: int = 0
    steps: int = 0
    rows: int = 0  # step rows fed to the model (its own row width, summed over steps)
    steps_by_kind: dict[str, int] = field(default_factory=dict)
    accepted_histogram: dict[int, int] = field(default_factory=dict)
    proposed: dict[str, int] = field(default_factory=dict)  # tree rows each source put in the steps that ran
    accepted_from: dict[str, int] = field(default_factory=dict)  # accepted tree rows, by source

    @property
    def compression(self) -> float:
        """New tokens per decode step (1.0 for plain decoding)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def mean_width(self) -> float:
        return self.rows / self.steps if self.steps else 0.0

    def record(self, kind: StepKind, width: int, accepted: int) -> None:
        self.steps += 1
        self.rows += width
        self.new_tokens += accepted
        name = kind.name.lower()
        self.steps_by_kind[name] = self.steps_by_kind.get(name, 0) + 1
        self.accepted_histogram[accepted] = self.accepted_histogram.get(accepted, 0) + 1

    def record_sources(self, proposed: Seq[int], accepted: Seq[int]) -> None:
        """Tree rows each source (by `Source` value) put in a step that ran, and how many were accepted."""
        for counts, by_source in ((self.proposed, proposed), (self.accepted_from, accepted)):
            for src, count in enumerate(by_source):
                if count:
                    counts[SOURCE_NAMES[src]] = counts.get(SOURCE_NAMES[src], 0) + count


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """log p(token | text before it) under the model's raw distribution (log-softmax of its logits,
    before temperature, top-k or top-p), and the `top` most likely tokens there, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_top(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS):
        raise ValueError(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {value!r}")


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Row rows[i] of `logits` [T, V] is the distribution that produced tokens[i].

    A verified candidate token's row is the one the verification branch computed for it, which
    under the tree mask sees exactly the text before it: no extra forward is needed."""
    lp = torch.log_softmax(logits[list(rows)].float(), dim=-1)
    picked = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    if not top:
        return [TokenLogprob(t, v) for t, v in zip(tokens, picked)]
    top_values, top_ids = lp.topk(top, dim=-1)
    values, ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprob(t, v, tuple(zip(i, p))) for t, v, i, p in zip(tokens, picked, ids, values)]


@dataclass
class StepOutput:
    """One request's share of a step: the tokens it accepted, what kind of row it ran and how
    wide; on its last output the finish reason and the request's `SequenceStats`."""

    seq_id: str | int
    tokens: list[int]
    finish_reason: FinishReason | None = None
    kind: StepKind | None = None
    width: int = 0
    stats: SequenceStats | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first output; the first token has none

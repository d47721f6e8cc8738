"""Log-probabilities of the tokens a step accepted, read from the step's own logits rows."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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

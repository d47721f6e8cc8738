"""Sampling: warped next-token distributions and distribution-preserving verification."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or None) is greedy decoding; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if t is None or isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 100:
            raise ValueError(f"temperature must be a number in [0, 100], got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return not self.temperature


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities after temperature, then top-k, then top-p (the order of HF's warpers)."""
    z = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max()
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(p)  # ascending, as HF's TopPLogitsWarper
        cum = np.cumsum(p[order])
        drop = cum <= 1 - params.top_p
        drop[-1] = False  # always keep the most likely token
        p[order[drop]] = 0.0
        p /= p.sum()
    return p


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    return int(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right").clip(0, len(p) - 1))


def verify_sampling(
    dist_at: Callable[[int], np.ndarray],
    candidates: Sequence[Sequence[int]],
    rows: Sequence[Sequence[int]],
    rng: np.random.Generator,
) -> tuple[int, list[int]]:
    """Accept candidate tokens so that the output follows the model's warped distribution.

    `dist_at(row)` is the warped next-token distribution after the token at step row `row` (row
    0: the last accepted token); `rows[c][d]` is the step row of token d of candidate c
    (candidates of any length; a shared prefix may share rows). At each depth every distinct
    token of the surviving candidates is tried in order: accepted with probability p(token); on
    rejection its mass is removed and the rest renormalised. With no survivor the next token is
    drawn from what remains; after a full candidate, from the distribution after its last token.
    Returns (candidate index or -1, tokens).
    """
    alive = list(range(len(candidates)))
    p = dist_at(0).copy()
    accepted: list[int] = []
    chosen = -1
    depth = 0
    while alive:
        alive = [g for g in alive if len(candidates[g]) > depth]
        if not alive:
            break
        tried: set[int] = set()
        hit = None
        base = p.copy()
        for g in alive:
            tok = candidates[g][depth]
            if tok in tried:
                continue
            tried.add(tok)
            if rng.random() < p[tok]:
                hit = tok
                break
            p[tok] = 0.0
            total = p.sum()
            if total <= 0:  # only rounding can exhaust the mass; fall back to the unmodified distribution
                p = base
                break
            p /= total
        if hit is None:
            break
        alive = [g for g in alive if candidates[g][depth] == hit]
        chosen = alive[0]
        accepted.append(hit)
        p = dist_at(rows[chosen][depth]).copy()
        depth += 1
    accepted.append(sample(p, rng))
    return chosen, accepted

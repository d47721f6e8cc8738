"""Sampling: warped next-token distributions, and verification that keeps them exact.

Every output position p of a request has its own uniform u(seed, p). The token at p is the
inverse CDF of the model's warped distribution at u, exactly as plain sampling would draw it. A
step computes that token for every candidate row at once, so verifying a candidate is the greedy
walk over these sampled tokens: a candidate token is accepted iff it is the token the uniform picks.
The output is plain sampling's, token for token, and fixed by the seed up to rounding-level ties:
not by which candidates were tried, how wide the step was, or what else was batched. float32 logits
agree across step shapes only to rounding, so a near-tie can flip; bf16 logits round visibly
differently by step shape (docs/ARCHITECTURE.md "Sampling").
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or None) is greedy decoding; top_k 0, top_p 1 and min_p 0 switch those filters
    off (min_p: tokens less likely than min_p times the likeliest go, after top-p, as HF orders it).
    A seed makes the request's text reproducible; without one a random seed is drawn per request."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0

    MAX_TEMPERATURE = 100.0

    def __post_init__(self) -> None:
        t = self.temperature
        if t is None or isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= self.MAX_TEMPERATURE:
            raise ValueError(f"temperature must be a number in [0, {self.MAX_TEMPERATURE:g}], got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {m!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return not self.temperature


def new_seed() -> int:
    return secrets.randbits(63)


_MASK = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that scatters every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that draws output position `position` of a request seeded with `seed`:
    a counter-based stream (SplitMix64 of seed and position), so any position is drawn directly."""
    key = _mix64((seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK)
    return (_mix64((key + position * 0x9E3779B97F4A7C15) & _MASK) >> 11) * 2.0**-53


# top-p looks at this many likeliest tokens first; a row whose nucleus is wider (a flat
# distribution at a high temperature) is narrowed by bisection instead, never sorted whole
TOP_P_PREFIX = 1024


def warp_rows(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, then top-k, top-p and min-p (the order of HF's warpers), for rows
    [R, V] on the logits' device, in float64."""
    z = logits.double()
    # The row's maximum first: any positive temperature, however small, then leaves the likeliest
    # token(s) at 0 and sends the rest to -inf (the greedy limit), never inf - inf = NaN.
    z = (z - z.amax(dim=-1, keepdim=True)) / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = torch.topk(z, params.top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, -torch.inf)
    p = torch.softmax(z, dim=-1)
    if params.top_p < 1.0:
        p = _top_p(p, params.top_p)
    if params.min_p > 0.0:
        p = p.masked_fill(p < params.min_p * p.amax(dim=-1, keepdim=True), 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def _top_p(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """HF's TopPLogitsWarper on probabilities: in ascending order, tokens whose cumulative mass is at
    most 1 - top_p go (the likeliest always stays), i.e. a token stays while the mass strictly
    likelier than it is below top_p. The likeliest `TOP_P_PREFIX` nearly always hold the nucleus;
    a row they do not is narrowed by `_bracket` first."""
    k = min(TOP_P_PREFIX, p.shape[-1])
    top, order = torch.topk(p, k, dim=-1)  # descending
    keep = top.cumsum(-1) - top < top_p
    keep[:, 0] = True
    out = torch.zeros_like(p).scatter_(-1, order, top.masked_fill(~keep, 0.0))
    if k < p.shape[-1]:
        for r in torch.nonzero(top.sum(-1) < top_p).flatten().tolist():
            out[r] = _top_p_wide(p[r], top_p, top[r, -1])
    return out / out.sum(-1, keepdim=True)


def _top_p_wide(p: torch.Tensor, top_p: float, kth: torch.Tensor) -> torch.Tensor:
    """`_top_p` of one row [V] whose nucleus is wider than its likeliest `TOP_P_PREFIX`: tokens at or
    above `hi` stay, tokens below `lo` go, and only the few between are ranked."""
    lo, hi = _bracket(p, top_p, kth)
    above = p >= hi
    idx = torch.nonzero((p >= lo) & ~above).flatten()
    between = p[idx]
    # more than TOP_P_PREFIX between is one tied value (`_bracket`), ranked in index order unsorted
    if between.numel() <= TOP_P_PREFIX:
        between, order = torch.sort(between, descending=True, stable=True)
        idx = idx[order]
    likelier = (p * above).sum() + between.cumsum(-1) - between
    keep = above.index_fill(0, idx[likelier < top_p], True)
    return p * keep


def _bracket(p: torch.Tensor, top_p: float, kth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values lo < hi of a row [V] with the mass at or above lo at least top_p (so tokens below lo go)
    and the mass at or above hi below it (so tokens at or above hi stay), bisected on float64 bit
    patterns (ordered as the values are) until at most `TOP_P_PREFIX` tokens, or one value, lie in
    [lo, hi). A round is a compare, a count and a masked sum over the row: no sort."""
    lo = p.amin().view(torch.int64)
    hi = kth.view(torch.int64) + 1  # just above it the mass is below top_p: it is the k-th likeliest
    n_lo, n_hi = p.numel(), int((p >= hi.view(torch.float64)).sum())
    while n_lo - n_hi > TOP_P_PREFIX and int(hi - lo) > 1:
        mid = (lo + hi) // 2
        ge = p >= mid.view(torch.float64)
        if float((p * ge).sum()) >= top_p:
            lo, n_lo = mid, int(ge.sum())
        else:
            hi, n_hi = mid, int(ge.sum())
    return lo.view(torch.float64), hi.view(torch.float64)


def sample_rows(logits: torch.Tensor, params: SamplingParams, uniforms: Sequence[float]) -> list[int]:
    """The token each row's warped distribution gives at its uniform (inverse CDF), for rows [R, V]."""
    cdf = warp_rows(logits, params).cumsum(-1)
    u = torch.tensor(uniforms, dtype=cdf.dtype, device=cdf.device).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(1).tolist()

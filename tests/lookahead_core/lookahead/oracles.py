"""Numpy oracles of sampling for the statistical tests: one distribution at a time, drawn by its CDF."""
import itertools

import numpy as np
import torch

from lookahead_core.lookahead.sampling import SamplingParams, warp_rows
from lookahead_core.models.random_models import build_random_model

V = 8
PROMPT = [5]
POOL_SEED = [5, 0, 1, 5, 0, 2, 5, 3, 4, 5, 6, 7, 0, 1, 4]  # several continuations per key, shared first tokens
N, G = 3, 3
# Prompt-lookup-like candidates of other lengths, merged into the tree with the pool's: (5, 0, 1, 4)
# shares its first row with the pool's (0, 2) after 5.
LOOKUP = {5: (0, 1, 4), 0: (1,), 3: (4, 5, 0, 1)}
SAMPLES = 20_000
CONFIGS = {
    "temperature 1.0": SamplingParams(1.0),
    "temperature 0.7, top-p 0.9": SamplingParams(0.7, top_p=0.9),
    "top-k 5": SamplingParams(1.0, top_k=5),
}


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities after temperature, then top-k, then top-p (the order of HF's warpers)."""
    return warp_rows(torch.from_numpy(np.asarray(logits, dtype=np.float64))[None], params)[0].numpy()


def sample(p: np.ndarray, u: float) -> int:
    """The token whose CDF interval holds `u`."""
    return int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right").clip(0, len(p) - 1))


def sampling_model():
    """A tiny model whose next-token distributions are far from flat, over a vocabulary of V."""
    return build_random_model("llama", vocab_size=V, hidden=32, layers=2, heads=4, kv_heads=2, init_std=0.12, seed=3)


def next_token_logits(model) -> dict:
    """Next-token logits after PROMPT + every context of up to 3 tokens (one batched forward)."""
    table = {}
    for depth in range(4):
        ctxs = list(itertools.product(range(V), repeat=depth))
        ids = torch.tensor([PROMPT + list(c) for c in ctxs])
        with torch.no_grad():
            out = model(ids).logits[:, -1].double().numpy()
        table.update({c: out[i] for i, c in enumerate(ctxs)})
    return table


def exact_joint(table, params):
    joint = np.zeros((V, V, V))
    p1 = warp(table[()], params)
    for a in range(V):
        p2 = warp(table[(a,)], params)
        for b in range(V):
            joint[a, b] = p1[a] * p2[b] * warp(table[(a, b)], params)
    return joint


def counts(samples):
    c = np.zeros((V, V, V))
    for s in samples:
        c[s] += 1
    return c


def chi2_pvalue(stat, dof):
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def gof(obs, probs, min_expected=5.0):
    """Goodness of fit to exact probabilities; cells expected below 5 are pooled into one."""
    exp = probs.ravel() * obs.sum()
    obs = obs.ravel()
    small = exp < min_expected
    o = np.append(obs[~small], obs[small].sum())
    e = np.append(exp[~small], exp[small].sum())
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    return chi2_pvalue(stat, int(keep.sum()) - 1)


def two_sample(a, b, min_count=10):
    """Chi-square test of homogeneity of two count tables (sparse cells pooled)."""
    a, b = a.ravel(), b.ravel()
    small = (a + b) < min_count
    a = np.append(a[~small], a[small].sum())
    b = np.append(b[~small], b[small].sum())
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    n_a, n_b = a.sum(), b.sum()
    tot = a + b
    ea, eb = tot * n_a / (n_a + n_b), tot * n_b / (n_a + n_b)
    stat = float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum())
    return chi2_pvalue(stat, len(a) - 1)

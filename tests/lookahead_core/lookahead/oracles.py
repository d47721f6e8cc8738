"""Numpy oracles of sampling for the statistical tests: one distribution at a time, drawn by its CDF."""
import numpy as np
import torch

from lookahead_core.lookahead.sampling import SamplingParams, warp_rows


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities after temperature, then top-k, then top-p (the order of HF's warpers)."""
    return warp_rows(torch.from_numpy(np.asarray(logits, dtype=np.float64))[None], params)[0].numpy()


def sample(p: np.ndarray, u: float) -> int:
    """The token whose CDF interval holds `u`."""
    return int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right").clip(0, len(p) - 1))

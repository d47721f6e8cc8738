"""Where each token of one decode step sits, what it sees, and at which position."""
from __future__ import annotations

import numpy as np
import torch

from lookahead_core.lookahead.params import LookaheadParams


class StepLayout:
    """Token order of one step: [last token | window levels 0..n-2 | candidate tree rows].

    The mask and position offsets of the last token and the window are built once. Tree rows see
    the last token and their own ancestors, which change every step: the template gives them
    column 0 and the diagonal, and the step adds the ancestors from its `CandidateTree`.
    `params=None` is plain decoding: one token. A step may leave the window out (see
    `StepPacer`): `verify_template` is then the mask of [last token | tree rows].
    """

    def __init__(self, params: LookaheadParams | None, dtype: torch.dtype, device: torch.device | str) -> None:
        self.params = params
        n, w = (params.n, params.w) if params is not None else (2, 0)
        self.n, self.w = n, w
        self.g = params.g if params is not None else 0
        self.window_start = 1
        self.window_len = (n - 1) * w
        self.cand_start = 1 + self.window_len
        self.max_tree_rows = params.max_candidate_tokens if params is not None else 0
        self.max_tokens = self.cand_start + self.max_tree_rows
        # Rows whose outputs become the window's next level.
        self.newest_level_start = self.window_start + (n - 2) * w

        visible = np.zeros((self.max_tokens, self.max_tokens), dtype=bool)
        offsets = np.zeros(self.max_tokens, dtype=np.int64)
        visible[:, 0] = True
        np.fill_diagonal(visible, True)
        for level in range(n - 1):
            for j in range(w):
                row = self._window_index(level, j)
                offsets[row] = 1 + level + j
                # The chain of column j: level 0 up to column j, then column j up the levels.
                for i in range(j + 1):
                    visible[row, self._window_index(0, i)] = True
                for up in range(1, level + 1):
                    visible[row, self._window_index(up, j)] = True
        self.visible = visible
        self.offsets = offsets
        self.mask_template = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=device)
        self.mask_template[torch.from_numpy(visible).to(device)] = 0.0
        lean = 1 + self.max_tree_rows
        self.verify_template = torch.full((lean, lean), torch.finfo(dtype).min, dtype=dtype, device=device)
        self.verify_template[:, 0] = 0.0
        self.verify_template.diagonal().zero_()

    def _window_index(self, level: int, j: int) -> int:
        return self.window_start + level * self.w + j

"""Decoding of one sequence: prefill, then lookahead (or plain) steps over preallocated buffers."""
from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import numpy as np
import torch

from .kv_cache import SlotKVCache
from .model_runner import ModelRunner
from .params import LookaheadParams
from .sampling import SamplingParams
from .sequence import Sequence
from .shared_pool import SharedNGramPool
from .stopping import StopCondition


class SequenceDecoder:
    """Runs one `Sequence` with its own cache and step buffers, every buffer sized up front."""

    def __init__(
        self,
        runner: ModelRunner,
        prompt: Seq[int],
        params: LookaheadParams | None,
        stop: StopCondition,
        sampling: SamplingParams | None = None,
        shared_pool: SharedNGramPool | None = None,
    ) -> None:
        runner.check_tokens(prompt)
        runner.check_length(len(prompt) + stop.max_new_tokens)
        self.runner = runner
        self.seq = Sequence(0, prompt, params, stop, runner.layout, sampling, shared_pool)
        self.forward_s = 0.0
        self.step_s = 0.0
        max_tokens = self.seq.layout.max_tokens
        capacity = self.seq.prompt_len + stop.max_new_tokens + max_tokens
        self.cache = SlotKVCache(runner.num_layers, capacity)
        # ids and positions are filled on the host; on CPU the model reads them in place.
        self._host = torch.zeros((2, max_tokens), dtype=torch.long, pin_memory=runner.device.type == "cuda")
        self._host_np = self._host.numpy()
        self._dev = self._host if runner.device.type == "cpu" else torch.zeros_like(self._host, device=runner.device)
        # Invariant: zero outside the current step's block, so the committed prefix is visible.
        self._mask = torch.zeros((1, 1, max_tokens, capacity), dtype=runner.dtype, device=runner.device)
        self._mask_block = (0, 0)
        self._max_position = (runner.context_length or np.iinfo(np.int64).max) - 1

    # Single-sequence views of the state, for callers and tests.
    tokens = property(lambda self: self.seq.tokens)
    new_tokens = property(lambda self: self.seq.new_tokens)
    finished = property(lambda self: self.seq.finished)
    finish_reason = property(lambda self: self.seq.finish_reason)
    steps = property(lambda self: self.seq.steps)
    accepted_histogram = property(lambda self: self.seq.accepted_histogram)
    pool = property(lambda self: self.seq.pool)

    @torch.inference_mode()
    def prefill(self) -> None:
        """Cache every prompt token but the last, which the first decode step feeds."""
        prompt = self.seq.tokens[: self.seq.prompt_len]
        if len(prompt) > 1:
            ids = torch.tensor([prompt[:-1]], dtype=torch.long, device=self.runner.device)
            self.runner.prefill(ids, 0, self.cache)
            self.cache.length = ids.shape[1]

    @torch.inference_mode()
    def step(self) -> list[int]:
        """One forward: verify candidates, advance the window, commit the cache; returns new tokens."""
        seq = self.seq
        if seq.finished:
            raise RuntimeError("the sequence has finished")
        t0 = time.perf_counter()
        ids, pos = self._host_np[0], self._host_np[1]
        start = self.cache.length
        n_tok = seq.plan(ids)
        np.add(seq.layout.offsets[:n_tok], start, out=pos[:n_tok])
        np.minimum(pos[:n_tok], self._max_position, out=pos[:n_tok])
        if self._dev is not self._host:
            self._dev[:, :n_tok].copy_(self._host[:, :n_tok], non_blocking=True)
        mask = self._write_mask(start, n_tok)

        t1 = time.perf_counter()
        pred, logits = self.runner.forward(self._dev[0:1, :n_tok], self._dev[1:2, :n_tok], mask, self.cache)
        t2 = time.perf_counter()

        row, accepted = seq.accept(pred[0], logits[0] if seq.sampling is not None else None)
        self.cache.commit(start, kept=len(accepted), moved_from=start + row, moved=len(accepted) - 1)
        self.forward_s += t2 - t1
        self.step_s += time.perf_counter() - t0
        return accepted

    def _write_mask(self, start: int, n_tok: int) -> torch.Tensor:
        block = self._mask[0, 0]
        prev_start, prev_len = self._mask_block
        block[:prev_len, prev_start : prev_start + prev_len].zero_()
        block[:n_tok, start : start + n_tok].copy_(self.seq.layout.mask_template[:n_tok, :n_tok])
        self._mask_block = (start, n_tok)
        return self._mask[:, :, :n_tok, : start + n_tok]

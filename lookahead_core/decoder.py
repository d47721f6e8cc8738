"""Decoding of one sequence: prefill, then lookahead (or plain) steps over preallocated buffers."""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from .kv_cache import SlotKVCache
from .model_runner import ModelRunner
from .ngram_pool import NGramPool
from .params import LookaheadParams
from .stopping import StopCondition
from .verify import verify_greedy
from .window import LookaheadWindow


class SequenceDecoder:
    """Owns one sequence's cache, window, pool and step buffers; every buffer is sized up front.

    The last accepted token is not yet in the cache: each step feeds it first, so plain decoding
    is the layout with no window and no candidates, and every new token comes from a decode step.
    """

    def __init__(
        self,
        runner: ModelRunner,
        prompt: Sequence[int],
        params: LookaheadParams | None,
        stop: StopCondition,
    ) -> None:
        if len(prompt) == 0:
            raise ValueError("the prompt must hold at least one token")
        self.tokens: list[int] = [int(t) for t in prompt]
        runner.check_tokens(self.tokens)
        runner.check_length(len(self.tokens) + stop.max_new_tokens)
        self.runner = runner
        self.params = params
        self.stop = stop
        self.layout = runner.layout(params)
        self.prompt_len = len(self.tokens)
        self.finish_reason: str | None = None
        self.steps = 0
        self.accepted_histogram: dict[int, int] = {}
        self.forward_s = 0.0
        self.step_s = 0.0

        lay = self.layout
        capacity = self.prompt_len + stop.max_new_tokens + lay.max_tokens
        self.cache = SlotKVCache(runner.num_layers, capacity)
        # ids and positions are filled on the host; on CPU the model reads them in place.
        self._host = torch.zeros((2, lay.max_tokens), dtype=torch.long, pin_memory=runner.device.type == "cuda")
        self._host_np = self._host.numpy()
        self._dev = self._host if runner.device.type == "cpu" else torch.zeros_like(self._host, device=runner.device)
        # Invariant: zero outside the current step's block, so the committed prefix is visible.
        self._mask = torch.zeros((1, 1, lay.max_tokens, capacity), dtype=runner.dtype, device=runner.device)
        self._mask_block = (0, 0)
        self._max_position = (runner.context_length or np.iinfo(np.int64).max) - 1

        if params is not None:
            self.window = LookaheadWindow(params.n, params.w, self.tokens)
            self.pool = NGramPool(params.n, params.g)
            if params.pool_from_prompt:
                self.pool.add_sequence(self.tokens)

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @torch.inference_mode()
    def prefill(self) -> None:
        """Cache every prompt token but the last, which the first decode step feeds."""
        if self.prompt_len > 1:
            ids = torch.tensor([self.tokens[:-1]], dtype=torch.long, device=self.runner.device)
            self.runner.prefill(ids, self.cache)

    @torch.inference_mode()
    def step(self) -> list[int]:
        """One forward: verify candidates, advance the window, commit the cache; returns new tokens."""
        if self.finished:
            raise RuntimeError("the sequence has finished")
        t0 = time.perf_counter()
        lay, ids, pos = self.layout, self._host_np[0], self._host_np[1]
        last = self.tokens[-1]
        start = self.cache.length
        candidates = self.pool.lookup(last)[: lay.g] if self.params is not None else []
        n_tok = lay.step_tokens(len(candidates))

        ids[0] = last
        if self.params is not None:
            ids[lay.window_start : lay.cand_start] = self.window.flat()
            if candidates:
                ids[lay.cand_start : n_tok] = [t for cand in candidates for t in cand]
        np.add(lay.offsets[:n_tok], start, out=pos[:n_tok])
        np.minimum(pos[:n_tok], self._max_position, out=pos[:n_tok])
        if self._dev is not self._host:
            self._dev[:, :n_tok].copy_(self._host[:, :n_tok], non_blocking=True)
        mask = self._write_mask(start, n_tok)

        t1 = time.perf_counter()
        pred = self.runner.forward_argmax(self._dev[0:1, :n_tok], self._dev[1:2, :n_tok], mask, self.cache)
        t2 = time.perf_counter()

        chosen, accepted = verify_greedy(pred, candidates, lay.cand_start)
        accepted, self.finish_reason = self.stop.clip(accepted, len(self.tokens) - self.prompt_len)
        self.cache.commit(start, kept=len(accepted), moved_from=lay.candidate_row(chosen) + start, moved=len(accepted) - 1)
        if self.params is not None:
            pool = self.pool
            for ngram in self.window.update(pred[lay.newest_level_start : lay.cand_start]):
                pool.add(ngram[0], ngram[1:])
        before = len(self.tokens)
        self.tokens.extend(accepted)
        if self.params is not None and self.params.pool_from_prompt:
            self.pool.add_sequence(self.tokens, start=before - self.params.n + 1)

        self.steps += 1
        self.accepted_histogram[len(accepted)] = self.accepted_histogram.get(len(accepted), 0) + 1
        self.forward_s += t2 - t1
        self.step_s += time.perf_counter() - t0
        return accepted

    def _write_mask(self, start: int, n_tok: int) -> torch.Tensor:
        block = self._mask[0, 0]
        prev_start, prev_len = self._mask_block
        block[:prev_len, prev_start : prev_start + prev_len].zero_()
        block[:n_tok, start : start + n_tok].copy_(self.layout.mask_template[:n_tok, :n_tok])
        self._mask_block = (start, n_tok)
        return self._mask[:, :, :n_tok, : start + n_tok]

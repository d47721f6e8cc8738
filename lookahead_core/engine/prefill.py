"""Prompts into their KV slots: a stored prefix copied in, the rest one chunk per forward; the
first new token from the last chunk's last row."""
from __future__ import annotations

import time

import numpy as np
import torch

from lookahead_core.engine.logprobs import token_logprobs
from lookahead_core.engine.runner.kv_cache import BatchKVCache
from lookahead_core.engine.runner.model_runner import ModelRunner
from lookahead_core.engine.runner.prefix_cache import PrefixCache
from lookahead_core.engine.runner.step_buffers import BatchStepBuffers
from lookahead_core.engine.scheduler import Scheduler
from lookahead_core.engine.sequence import Sequence
from lookahead_core.engine.verification import StepOutput, first_token
from lookahead_core.lookahead.knowledge import ReplicaKnowledge


class Prefiller:
    """Runs the scheduler's prefill jobs on the engine's KV cache; a prompt prefilled whole is
    stored in the prefix cache (`prefixes`, None: off)."""

    def __init__(self, runner: ModelRunner, cache: BatchKVCache, buffers: BatchStepBuffers, scheduler: Scheduler,
                 knowledge: ReplicaKnowledge, prefixes: PrefixCache | None, successor_prefill: bool) -> None:
        self.runner, self.cache, self.buffers, self.scheduler = runner, cache, buffers, scheduler
        self.knowledge, self.prefixes, self.successor_prefill = knowledge, prefixes, successor_prefill
        chunk, capacity, dtype, device = scheduler.prefill_chunk, cache.capacity, runner.dtype, runner.device
        self._mask = torch.zeros((1, 1, chunk, capacity), dtype=dtype, device=device)
        self._causal = torch.full((chunk, chunk), torch.finfo(dtype).min, dtype=dtype, device=device).triu_(1)
        self.seconds = 0.0  # prefill forwards

    def run(self) -> list[StepOutput]:
        """Prompt chunks of `prefill_chunk` tokens in all, one forward per prompt, each after any
        stored prefix of it is copied in; the first new token of each prompt they complete. Short
        prompts arriving together (a burst of users) are prefilled in one step, not one a step."""
        outputs: list[StepOutput] = []
        budget = self.scheduler.prefill_chunk
        while budget > 0:
            job = self.scheduler.next_prefill(budget)
            if job is not None and job[1] == 0 and self._reuse_prefix(job[0]):
                job = self.scheduler.next_prefill(budget)  # the rest of the same prompt: at least its last token
            if job is None:
                break
            done = self._prefill(*job)
            outputs.extend(done)
            budget -= job[2]
            if not done:  # the prompt goes on next step
                break
        return outputs

    def _prefill(self, seq: Sequence, start: int, n: int) -> list[StepOutput]:
        slot = seq.slot
        assert slot is not None and n > 0  # admitted into a slot; a prompt's last token is never stored
        t0 = time.perf_counter()
        ids = torch.tensor([seq.tokens[start : start + n]], dtype=torch.long, device=self.runner.device)
        m = self._mask[0, 0]
        m[:n, start : start + n].copy_(self._causal[:n, :n])
        self.cache.prepare_slot(slot, start, n)
        top = seq.prompt_logprobs
        succ = self.knowledge.successors if self.successor_prefill else None
        logits = self.runner.prefill(ids, start, self.cache, self._mask[:, :, :n, : start + n],
                                     all_logits=top is not None or succ is not None)
        if succ is not None:  # the prompt's own tokens get the successors the model gives them here
            self.knowledge.observe_prefill(ids[0].cpu().numpy(), logits[0].topk(succ.k, dim=-1).indices.cpu().numpy())
        m[:n, start : start + n].zero_()
        if top is not None and seq.prompt_lp is not None:  # row i predicts prompt token start + i + 1
            rows = min(n, seq.prompt_len - 1 - start)
            seq.prompt_lp += token_logprobs(logits[0], range(rows), seq.tokens[start + 1 : start + rows + 1], top)
        outputs = []
        if self._prefilled(seq, slot, start + n, n):
            last = logits[0, -1:]
            pred = last.argmax(dim=-1, keepdim=True)  # [1, 1]
            table = self.knowledge.successors
            if table is not None and succ is None:  # with the argmax in one transfer, as a decode step
                pred = torch.cat([pred, last.topk(table.k, dim=-1).indices], dim=-1)
            tokens = pred.cpu().numpy()
            if table is not None and succ is None:  # the last prompt token's successors, as its decode step recorded
                self.knowledge.observe_prefill(np.asarray(seq.tokens[-1:]), tokens[:, 1:])
            outputs.append(first_token(seq, last, int(tokens[0, 0])))
        self.seconds += time.perf_counter() - t0
        return outputs

    def _reuse_prefix(self, seq: Sequence) -> bool:
        """Copy the longest stored prefix of a newly admitted prompt into its slot; True if any.
        Not for requests that want the prompt's logprobs (a copied prefix has no logits)."""
        if self.prefixes is None or seq.prompt_logprobs is not None or self.successor_prefill:
            return False
        assert seq.slot is not None  # admitted into a slot
        reused = self.prefixes.load(seq.tokens[: seq.prompt_len - 1], self.cache, seq.slot)
        if reused:
            self._prefilled(seq, seq.slot, reused, reused)
        return reused > 0

    def _prefilled(self, seq: Sequence, slot: int, length: int, tokens: int) -> bool:
        """`tokens` more of the prompt are in the slot, `length` in all; True when the prompt is whole
        (the sequence starts decoding)."""
        self.cache.lengths[slot] = length
        if self.scheduler.prefill_done(tokens) is None:
            return False
        self.buffers.reset_slot(slot, length)
        if self.prefixes is not None:  # as it is looked up: each prompt but its last token
            self.prefixes.store(seq.tokens[: seq.prompt_len - 1], self.cache, slot)
        return True

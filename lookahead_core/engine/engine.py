"""The continuous-batching engine: requests join and leave at any step, one decode forward per step."""
from __future__ import annotations

import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np
import torch

from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.kv_cache import BatchKVCache
from lookahead_core.engine.logprobs import TokenLogprob, check_top, token_logprobs
from lookahead_core.engine.model_runner import ModelRunner
from lookahead_core.engine.scheduler import Scheduler
from lookahead_core.engine.sequence import Sequence, Status
from lookahead_core.engine.step_buffers import BatchStepBuffers
from lookahead_core.lookahead.pacing import batch_width
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams
from lookahead_core.lookahead.shared_pool import SharedNGramPool
from lookahead_core.lookahead.stopping import StopCondition


class EngineOverloaded(RuntimeError):
    """The waiting queue is full."""


@dataclass
class StepOutput:
    seq_id: str | int
    tokens: list[int]
    finish_reason: str | None = None
    stats: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first output; the first token has none


def _stats(seq: Sequence) -> dict:
    new = len(seq.new_tokens)
    return {
        "prompt_tokens": seq.prompt_len,
        "new_tokens": new,
        "steps": seq.steps,
        "compression": new / seq.steps if seq.steps else 0.0,
        "accepted_histogram": dict(sorted(seq.accepted_histogram.items())),
        "planned_tokens": seq.planned_tokens,
    }


class Engine:
    """Synchronous engine: `add_request`, `step`, `abort`, `set_params`, `queue_depth`.

    Each step runs at most one prefill chunk (for the sequence being admitted) and one decode
    forward over every running sequence, each with its own layout, padded to the widest.
    """

    def __init__(self, model: torch.nn.Module | ModelRunner, config: EngineConfig | None = None) -> None:
        self.runner = model if isinstance(model, ModelRunner) else ModelRunner(model)
        self.config = config or EngineConfig()
        ctx = self.runner.context_length
        self.max_seq_len = self.config.max_seq_len or ctx or 2048
        if ctx is not None and self.max_seq_len > ctx:
            raise ValueError(f"max_seq_len {self.max_seq_len} exceeds the model's context length {ctx}")
        self.runner.check_length(self.max_seq_len)
        cfg, r = self.config, self.runner
        capacity = self.max_seq_len + cfg.max_step_tokens
        self.cache = BatchKVCache(r.num_layers, cfg.max_batch, capacity, r.device)
        self.buffers = BatchStepBuffers(cfg.max_batch, cfg.max_step_tokens, capacity, r.dtype, r.device)
        self.scheduler = Scheduler(cfg.max_batch, cfg.prefill_chunk)
        self.shared_pool = SharedNGramPool(cfg.shared_pool_cap, cfg.shared_pool_keys, cfg.shared_pool_text) if cfg.shared_pool_cap else None
        self._prefill_mask = torch.zeros((1, 1, cfg.prefill_chunk, capacity), dtype=r.dtype, device=r.device)
        self._causal = torch.full((cfg.prefill_chunk, cfg.prefill_chunk), torch.finfo(r.dtype).min, dtype=r.dtype, device=r.device).triu_(1)
        self._max_position = (ctx or np.iinfo(np.int64).max) - 1
        self._seqs: dict[str | int, Sequence] = {}
        self._finished_early: list[StepOutput] = []
        self.forward_s = 0.0  # decode forwards
        self.prefill_s = 0.0
        self.step_s = 0.0  # whole steps, prefill included
        self.steps = 0  # lifetime counters, for health and leak checks
        self.aborted = 0

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        seq_id: str | int,
        prompt: Seq[int],
        *,
        max_new_tokens: int,
        params: LookaheadParams | None = None,
        eos_token_id: int | Iterable[int] | None = None,
        stop_token_ids: Iterable[int] = (),
        sampling: SamplingParams | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        """Queue a request; raises ValueError (bad request) or EngineOverloaded (queue full).

        logprobs / prompt_logprobs: report each new / prompt token's log-probability with that
        many most likely alternatives (0: the token's own only; None: not at all)."""
        if seq_id in self._seqs:
            raise ValueError(f"request id {seq_id!r} is already in the engine")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if params is not None and not isinstance(params, LookaheadParams):
            raise TypeError(f"params must be LookaheadParams or None, got {type(params).__name__}")
        self.config.check_params(params)
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams or None, got {type(sampling).__name__}")
        check_top("logprobs", logprobs)
        check_top("prompt_logprobs", prompt_logprobs)
        stop = StopCondition.build(max_new_tokens, eos_token_id, stop_token_ids)
        if max_new_tokens > self.config.max_new_tokens:
            raise ValueError(f"max_new_tokens={max_new_tokens} exceeds this engine's limit of {self.config.max_new_tokens}")
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens plus max_new_tokens={max_new_tokens} exceeds this engine's "
                f"limit of {self.max_seq_len} tokens"
            )
        self.runner.check_tokens(prompt)
        # Requests that will get a free slot at the next step are not "waiting"; a burst that
        # arrives between two steps must not be refused while slots are free.
        sched = self.scheduler
        free = self.config.max_batch - len(sched.running) - (sched.prefilling is not None)
        if len(sched.waiting) >= self.config.max_waiting + max(free, 0):
            raise EngineOverloaded(f"{len(sched.waiting)} requests are already waiting for a slot")
        seq = Sequence(seq_id, prompt, params, stop, self.runner.layout, sampling, self.shared_pool)
        seq.logprobs, seq.prompt_logprobs = logprobs, prompt_logprobs
        if prompt_logprobs is not None:
            seq.prompt_lp = [None]
        self._seqs[seq_id] = seq
        self.scheduler.add(seq)

    def set_params(self, seq_id: str | int, params: LookaheadParams | None) -> None:
        """Change a request's (N, W, G) from its next step on."""
        self.config.check_params(params)
        seq = self._seqs.get(seq_id)
        if seq is not None:
            seq.set_params(params)

    def abort(self, seq_id: str | int) -> bool:
        """Stop a request; its slot is freed at the next step. False if it is unknown or done."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.finished:
            return False
        seq.finish_reason = "abort"
        seq.status = Status.FINISHED
        sched = self.scheduler
        if sched.remove_waiting(seq):
            del self._seqs[seq_id]
        elif sched.prefilling is seq:
            sched.prefilling = None
            self.cache.lengths[len(sched.running)] = 0
            del self._seqs[seq_id]
        self._finished_early.append(StepOutput(seq_id, [], "abort", _stats(seq)))
        self.aborted += 1
        return True

    def abort_all(self) -> None:
        """Drop every request and free every slot (after a failed step)."""
        sched = self.scheduler
        for seq in self._seqs.values():
            seq.finish_reason, seq.status = "abort", Status.FINISHED
        self._seqs.clear()
        self._finished_early.clear()
        sched.waiting.clear()
        sched.running.clear()
        sched.prefilling = None
        for slot in range(self.config.max_batch):
            self.cache.lengths[slot] = 0
            self.buffers.reset_slot(slot, 0)

    def queue_depth(self) -> tuple[int, int]:
        """(running, waiting); the sequence being prefilled counts as waiting."""
        s = self.scheduler
        return len(s.running), len(s.waiting) + (s.prefilling is not None)

    def has_work(self) -> bool:
        return bool(len(self.scheduler) or self._finished_early)

    def running_progress(self) -> dict[str | int, tuple[LookaheadParams | None, int, int, int]]:
        """(params, decode steps, new tokens, step rows fed) of each running sequence."""
        return {seq.seq_id: (seq.params, seq.steps, len(seq.tokens) - seq.prompt_len, seq.planned_tokens)
                for seq in self.scheduler.running}

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        outputs, self._finished_early = self._finished_early, []
        self._retire()
        # Admit while the next prompt needs no prefill forward (one token); at most one chunk runs.
        while (job := self.scheduler.next_prefill()) is not None:
            self._prefill(*job)
            if job[2] > 0:
                break
        if self.scheduler.running:
            outputs.extend(self._decode())
            self._retire()
        self.steps += 1
        self.step_s += time.perf_counter() - t0
        return outputs

    def _prefill(self, seq: Sequence, start: int, n: int) -> None:
        slot = len(self.scheduler.running)
        t0 = time.perf_counter()
        if n > 0:
            ids = torch.tensor([seq.tokens[start : start + n]], dtype=torch.long, device=self.runner.device)
            m = self._prefill_mask[0, 0]
            m[:n, start : start + n].copy_(self._causal[:n, :n])
            self.cache.prepare_slot(slot, start, n)
            top = seq.prompt_logprobs
            logits = self.runner.prefill(ids, start, self.cache, self._prefill_mask[:, :, :n, : start + n], all_logits=top is not None)
            m[:n, start : start + n].zero_()
            if top is not None:  # row i predicts prompt token start + i + 1
                seq.prompt_lp += token_logprobs(logits[0], range(n), seq.tokens[start + 1 : start + n + 1], top)
        self.prefill_s += time.perf_counter() - t0
        self.cache.lengths[slot] = start + n
        if self.scheduler.prefill_done(n) is not None:
            self.buffers.reset_slot(slot, start + n)

    def _decode(self) -> list[StepOutput]:
        running = self.scheduler.running
        buf, cache, lengths = self.buffers, self.cache, self.cache.lengths
        rows = len(running)
        costs = self.runner.costs
        proposals = [seq.propose(costs, rows) for seq in running]
        menus = [menu for menu, _ in proposals if menu is not None]
        cap = max(floor for _, floor in proposals)
        if menus:
            cap = batch_width(menus, lambda w: costs.ratio(rows, w), cap)
        widths = [seq.plan(buf.ids[b], cap) for b, seq in enumerate(running)]
        width = max(widths)
        for b, seq in enumerate(running):
            n, start = widths[b], lengths[b]
            pos = buf.pos[b]
            np.add(seq.offsets[:n], start, out=pos[:n])
            pos[n:width] = start
            np.minimum(pos[:width], self._max_position, out=pos[:width])
            buf.ids[b, n:width] = 0
            np.add(buf.arange[:width], start, out=buf.write_index[b, :width])
            buf.write_block(b, start, seq.template[:n, :n], width)
            tree = seq.tree
            if tree.size > 1:
                buf.write_tree(b, seq.cand_start, tree.visible[: tree.size, : tree.size])
        buf.to_device(rows, width)
        kv_len = max(lengths[:rows]) + width
        cache.prepare_rows(rows, buf.dev[2, :rows, :width], kv_len)
        t1 = time.perf_counter()
        pred, logits = self.runner.forward(buf.dev[0, :rows, :width], buf.dev[1, :rows, :width], buf.mask[:rows, :, :width, :kv_len], cache)
        self.forward_s += time.perf_counter() - t1

        outputs, slots, src, dst = [], [], [], []
        for b, seq in enumerate(running):
            rows, accepted = seq.accept(pred[b], logits[b] if seq.sampling is not None else None)
            start = lengths[b]
            if rows:  # the accepted candidate's rows move right behind the last token
                slots.extend([b] * len(rows))
                src.extend(start + r for r in rows)
                dst.extend(range(start + 1, start + 1 + len(rows)))
            lengths[b] = start + len(accepted)
            out = StepOutput(seq.seq_id, accepted, seq.finish_reason, _stats(seq) if seq.finished else {})
            if seq.logprobs is not None:
                out.logprobs = token_logprobs(logits[b], [0, *rows], accepted, seq.logprobs)
            if seq.prompt_lp is not None:
                out.prompt_logprobs, seq.prompt_lp = seq.prompt_lp, None
            outputs.append(out)
        if slots:
            cache.move_entries(slots, src, dst)
        return outputs

    def _retire(self) -> None:
        """Free the slots of finished sequences, keeping running ones in slots [0, running)."""
        sched, cache = self.scheduler, self.cache
        running = sched.running
        before = len(running)
        b = before - 1
        while b >= 0:
            if running[b].finished:
                self._seqs.pop(running[b].seq_id, None)
                if self.shared_pool is not None:
                    self.shared_pool.add_text(running[b].tokens)
                last = len(running) - 1
                if b != last:
                    cache.move_slot(last, b)
                    running[b] = running[last]
                    self.buffers.reset_slot(b, cache.lengths[b])
                else:
                    cache.lengths[b] = 0
                running.pop()
            b -= 1
        if sched.prefilling is not None and len(running) != before:
            cache.move_slot(before, len(running))

"""The continuous-batching engine: requests join and leave at any step, one decode forward per step."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from lookahead_core.constraints.grammar import Grammars
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.graphs.package_store import PackageStore
from lookahead_core.engine.io import EngineRequest, StepOutput
from lookahead_core.engine.runner.model_runner import ModelRunner
from lookahead_core.engine.runner.sizing import size_engine
from lookahead_core.engine.step.planner import StepPlan, StepPlanner
from lookahead_core.engine.step.scheduler import Scheduler
from lookahead_core.engine.step.sequence import Sequence
from lookahead_core.engine.step.verdicts import prefilled, verify_step
from lookahead_core.lookahead.drafter import plain_span
from lookahead_core.lookahead.knowledge import ReplicaKnowledge
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.stopping import FinishReason

log = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """The waiting queue is full."""


class Engine:
    """Synchronous engine: `add_request`, `step`, `abort`, `queue_depth`.

    Each step prefills at most `prefill_chunk` prompt tokens (of the sequences being admitted) and
    runs one decode forward over every running sequence, each with its own span, padded to the widest. The
    scheduler decides which sequence holds which KV slot; the runner carries out its slot moves.
    """

    def __init__(self, model: torch.nn.Module | ModelRunner, config: EngineConfig | None = None,
                 free_bytes: int | None = None, grammars: Grammars | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        self.grammars = grammars  # None: requests with a grammar are refused
        self.runner = r = model if isinstance(model, ModelRunner) else ModelRunner(
            model, max_layouts=cfg.layout_cache, weight_layout=cfg.weight_layout)
        r.costs.prior_slope = cfg.cost_prior_slope
        cfg.check_device(r.device.type)
        ctx = r.context_length
        self.max_seq_len = cfg.max_seq_len or ctx or 2048
        if ctx is not None and self.max_seq_len > ctx:
            raise ValueError(f"max_seq_len {self.max_seq_len} exceeds the model's context length {ctx}")
        r.check_length(self.max_seq_len)
        if cfg.successor_topk > r.vocab_size:  # topk over the vocabulary would fail every step
            raise ValueError(f"engine.successor_topk {cfg.successor_topk} exceeds the model's vocabulary of "
                             f"{r.vocab_size} tokens; set it to at most {r.vocab_size} (0 turns successor trees off)")
        self.knowledge = ReplicaKnowledge(cfg, r.vocab_size)  # what the replica learns across requests
        sizing = size_engine(r, cfg, self.max_seq_len, self.knowledge.planned_bytes, free_bytes)
        self.kv_plan, self.memory = sizing.kv, sizing.memory
        self.max_batch = slots = sizing.kv.slots
        r.allocate(slots, sizing.capacity, cfg.max_step_tokens, sizing.chunk, cfg.prefix_cache_tokens)
        self._kv = r.cache  # the runner's KV is this engine's while it runs
        self.scheduler = Scheduler(slots, sizing.chunk, cfg.request_slots or max(1, slots // 2),
                                   share_prefill=not cfg.successor_prefill)
        self.planner = StepPlanner(slots, cfg.slo_tpot_ms, cfg.row_price, self.knowledge.yield_bias)
        self._max_position = (ctx or np.iinfo(np.int64).max) - 1
        self._seqs: dict[str | int, Sequence] = {}
        self._finished_early: list[StepOutput] = []
        self.forward_s = 0.0  # decode forwards
        self.prefill_s = 0.0  # prompt chunks: their KV, forwards and first tokens
        self.step_s = 0.0  # whole steps, prefill included
        self.steps = 0  # lifetime counters, for health and leak checks
        self.aborted = 0
        if sizing.buckets:
            store = PackageStore(cfg.compile_dir) if cfg.compile_dir else None
            r.build_graphs(sizing.buckets, cfg.compile, store, cfg.compile_workers).start()

    # ---- requests -------------------------------------------------------------------------

    def resolve(self, req: EngineRequest) -> LookaheadParams | None:
        """The (N, W, G) a request runs: its own, the engine's for "auto", None for "off"."""
        return self.config.resolve(req.lookahead)

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request; raises ValueError (beyond this engine's limits) or EngineOverloaded (queue full)."""
        if not isinstance(req, EngineRequest):
            raise TypeError(f"add_request takes an EngineRequest, got {type(req).__name__}")
        if req.request_id in self._seqs:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        params = self.resolve(req)
        new = req.max_new_tokens
        if new > self.config.max_new_tokens:
            raise ValueError(f"max_new_tokens={new} exceeds this engine's limit of {self.config.max_new_tokens}")
        if len(req.prompt) + new > self.max_seq_len:
            raise ValueError(f"prompt of {len(req.prompt)} tokens plus max_new_tokens={new} exceeds this engine's "
                             f"limit of {self.max_seq_len} tokens")
        self.runner.check_tokens(req.prompt, max(req.logprobs or 0, req.prompt_logprobs or 0))
        if req.rules is not None and req.rules.max_token >= self.runner.vocab_size:
            raise ValueError(f"logit_bias names token {req.rules.max_token}, beyond the vocabulary of "
                             f"{self.runner.vocab_size} tokens")
        # Requests that will get a free slot at the next step are not "waiting"; a burst that
        # arrives between two steps must not be refused while slots are free.
        sched = self.scheduler
        if len(sched.waiting) >= self.config.max_waiting + max(sched.free_slots(), 0):
            raise EngineOverloaded(f"{len(sched.waiting)} requests are already waiting for a slot")
        seq = Sequence.of(req, params, self.runner.layout, self.knowledge, self.grammars, self.runner.vocab_size)
        self._seqs[req.request_id] = seq
        sched.add(seq)

    def abort(self, seq_id: str | int) -> bool:
        """Stop a request; its slot is freed at once, or at the next step if it is running. False
        if it is unknown or done."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.finished:
            return False
        running = seq in self.scheduler.running
        self.runner.apply(self.scheduler.abort(seq))
        if not running:
            del self._seqs[seq_id]
        self._finished_early.append(StepOutput(seq_id, [], FinishReason.ABORT, stats=seq.stats))
        self.aborted += 1
        return True

    def finish(self, seq_id: str | int, reason: FinishReason, kept: int | None = None) -> bool:
        """The caller ended a request: a stop string in its text (STOP, `kept` new tokens before
        it) or its deadline (TIMEOUT). Unlike an abort, a running request's text is finished text
        (the history and the shared pool get it) and it is not counted as aborted. False if it is
        unknown or done."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.finished:
            return False
        if seq not in self.scheduler.running:  # nothing decoded yet: it leaves as an abort would
            self.runner.apply(self.scheduler.abort(seq, reason))
            del self._seqs[seq_id]
        else:
            if kept is not None:
                del seq.tokens[seq.prompt_len + kept :]
            self.scheduler.abort(seq, reason)
        self._finished_early.append(StepOutput(seq_id, [], reason, stats=seq.stats))
        return True

    def abort_all(self) -> None:
        """Drop every request and free every slot (after a failed step)."""
        self.scheduler.abort_all()
        self._seqs.clear()
        self._finished_early.clear()
        self.runner.reset()

    def close(self) -> None:
        """The host stops: nothing more is made ready in the background."""
        self.runner.close()

    def queue_depth(self) -> tuple[int, int]:
        """(running, waiting); the sequence being prefilled counts as waiting."""
        s = self.scheduler
        return len(s.running), len(s.waiting) + (s.prefilling is not None)

    def has_work(self) -> bool:
        return bool(len(self.scheduler) or self._finished_early)

    def idle_turn(self, pending=lambda: False) -> bool:
        """With no request in, the runner's idle work (`ModelRunner.idle_turn`), none where
        `pending()` says a command waits; True if a graph call ran."""
        return not self.has_work() and self.runner.idle_turn(pending)

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Schedule, prefill the prompt chunks, plan, run one decode forward over the sequences
        running before them, verify, commit. A prompt a chunk completed has its first token from the
        prefill and decodes from the next step, so that token waits for no decode forward."""
        t0 = time.perf_counter()
        if self.runner.cache is not self._kv:
            raise RuntimeError("another engine allocated this engine's ModelRunner anew: a runner serves one "
                               "engine at a time")
        outputs, self._finished_early = self._finished_early, []
        batch = self.scheduler.schedule(self._prefix_match)
        if batch.retired:  # ended from outside the last step (aborted, finished by the caller)
            self._retired(batch.retired)
            self.runner.apply(batch.moves)
        if batch.prefill:
            t1 = time.perf_counter()
            successors = self.config.successor_prefill and self.knowledge.successors is not None
            every = [job.seq.prompt_logprobs is not None or successors for job in batch.prefill]
            for job, logits in zip(batch.prefill, self.runner.prefill_jobs(batch.prefill, every)):
                if (first := prefilled(job, logits, self.knowledge, successors)) is not None:
                    outputs.append(first)
            self.prefill_s += time.perf_counter() - t1
        if batch.decode:
            plan = self._plan(batch.decode, batch.behind)
            outputs.extend(self._decode(plan))
        else:
            self.planner.idle()
        done, moves = self.scheduler.retire()
        if done:
            self._retired(done)
            self.runner.apply(moves)
        self.steps += 1
        self.step_s += time.perf_counter() - t0
        return outputs

    def _prefix_match(self, seq: Sequence) -> int:
        """The prompt tokens a stored prefix gives `seq`: none where the request wants the prompt's
        logprobs (a copied prefix has no logits), nor where the prefill feeds the successors table."""
        if seq.prompt_logprobs is not None or self.config.successor_prefill:
            return 0
        return self.runner.prefix_match(seq.tokens[: seq.prompt_len - 1])

    def _plan(self, running: list[Sequence], behind: int) -> StepPlan:
        """Each running request drafts at the planner's row price, the planner picks each kind, and
        each request lays out its span of the step's tokens."""
        planner = self.planner
        prices = self.runner.costs.prices(planner.batch(len(running) + behind))
        price = planner.row_price(prices)
        due = planner.drafts_due(len(running) + behind)
        drafts = [seq.drafter.draft(seq.tokens, price, seq.shaper.grammar if seq.shaper is not None else None)
                  if seq.drafter is not None and due else None for seq in running]
        choices = planner.plan(drafts, price, prices)
        spans = [plain_span(seq.layout) if seq.drafter is None or draft is None
                 else seq.drafter.write(draft, choice, seq.tokens[-1])
                 for seq, draft, choice in zip(running, drafts, choices)]
        return StepPlan(running, drafts, spans, max(span.width for span in spans))

    def _decode(self, plan: StepPlan) -> list[StepOutput]:
        """One decode forward over the plan; each request's verdict, committed to its KV slot."""
        know = self.knowledge
        succ = know.successors
        before = self.runner.decode_s
        tokens, logits = self.runner.decode_plan(plan, self._max_position, topk=succ.k if succ is not None else 0)
        self.forward_s += self.runner.decode_s - before  # the forward alone: staging is the host's
        pred = (tokens[..., 0] if succ is not None else tokens).tolist()
        if succ is not None:
            assert self.runner.buffers is not None
            know.observe_forward(self.runner.buffers.ids, tokens, [span.width for span in plan.spans])
        outputs, kept = verify_step(plan, pred, logits)
        accepted = [len(out.tokens) for out in outputs]
        self.runner.commit(accepted, kept)
        self.planner.learn(accepted)
        return outputs

    def _retired(self, done: list[Sequence]) -> None:
        for seq in done:
            self._seqs.pop(seq.seq_id, None)
            if seq.finish_reason is not FinishReason.ABORT:
                self.knowledge.add_finished_text(seq.tokens)

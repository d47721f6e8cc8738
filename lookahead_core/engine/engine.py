"""The continuous-batching engine: requests join and leave at any step, one decode forward per step."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from lookahead_core.engine.bucket_staging import Bucket
from lookahead_core.engine.compiled_forward import CompiledForward
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.kv_budget import KVPlan, free_memory, plan_kv
from lookahead_core.engine.kv_cache import BatchKVCache
from lookahead_core.engine.model_runner import ModelRunner
from lookahead_core.engine.planner import StepPlanner
from lookahead_core.engine.prefill import Prefiller
from lookahead_core.engine.prefix_cache import PrefixCache
from lookahead_core.engine.request import EngineRequest
from lookahead_core.engine.scheduler import Scheduler, SlotMove
from lookahead_core.engine.sequence import Sequence
from lookahead_core.engine.step_buffers import BatchStepBuffers
from lookahead_core.engine.step_plan import StepPlan
from lookahead_core.engine.verification import StepOutput, update
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
    scheduler decides which sequence holds which KV slot; the engine applies its slot moves.
    """

    def __init__(self, model: torch.nn.Module | ModelRunner, config: EngineConfig | None = None,
                 free_bytes: int | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        self.runner = r = model if isinstance(model, ModelRunner) else ModelRunner(model, max_layouts=cfg.layout_cache)
        r.costs.prior_slope = cfg.cost_prior_slope
        ctx = r.context_length
        self.max_seq_len = cfg.max_seq_len or ctx or 2048
        if ctx is not None and self.max_seq_len > ctx:
            raise ValueError(f"max_seq_len {self.max_seq_len} exceeds the model's context length {ctx}")
        r.check_length(self.max_seq_len)
        if cfg.successor_topk > r.vocab_size:  # topk over the vocabulary would fail every step
            raise ValueError(f"engine.successor_topk {cfg.successor_topk} exceeds the model's vocabulary of "
                             f"{r.vocab_size} tokens; set it to at most {r.vocab_size} (0 turns successor trees off)")
        capacity = self.max_seq_len + cfg.max_step_tokens
        budget = cfg.kv_cache_memory
        assert not isinstance(budget, str)  # EngineConfig parses memory strings into bytes
        if (budget is None or isinstance(budget, float)) and free_bytes is None:  # a share of it, or checked against it
            free_bytes = free_memory(r.device)
        self.knowledge = ReplicaKnowledge(cfg, r.vocab_size)  # what the replica learns across requests
        # the tables live in host memory: on a CPU replica they share the free memory the KV is fitted to
        self.kv_plan: KVPlan = plan_kv(cfg.max_batch, capacity, r.kv_bytes_per_token,
                                       cfg.max_step_tokens * capacity * r.dtype.itemsize, budget, free_bytes,
                                       reserved_tokens=cfg.prefix_cache_tokens,
                                       learned_bytes=self.knowledge.planned_bytes,
                                       learned_in_free=r.device.type == "cpu")
        self.max_batch = slots = self.kv_plan.slots
        self.cache = BatchKVCache(r.num_layers, slots, capacity, r.device)
        self.buffers = BatchStepBuffers(slots, cfg.max_step_tokens, capacity, r.dtype, r.device)
        chunk = min(cfg.prefill_chunk, self.max_seq_len)  # a prompt is shorter: its masks need no more rows
        self.scheduler = Scheduler(slots, chunk)
        self.planner = StepPlanner(r.costs, slots, cfg.slo_tpot_ms, cfg.row_price, self.knowledge.yield_bias)
        self.prefixes = PrefixCache(cfg.prefix_cache_tokens) if cfg.prefix_cache_tokens else None
        self.prefiller = Prefiller(r, self.cache, self.buffers, self.scheduler, self.knowledge, self.prefixes,
                                   cfg.successor_prefill)
        self._max_position = (ctx or np.iinfo(np.int64).max) - 1
        self._seqs: dict[str | int, Sequence] = {}
        self._finished_early: list[StepOutput] = []
        self.forward_s = 0.0  # decode forwards
        self.step_s = 0.0  # whole steps, prefill included
        self.steps = 0  # lifetime counters, for health and leak checks
        self.aborted = 0
        r.graphs = self._compiled_forward(cfg) if cfg.compile != "off" else None

    def _compiled_forward(self, cfg: EngineConfig) -> CompiledForward:
        """The decode forward compiled for the configured buckets: before the first step ("on") or
        on a background thread while steps run eagerly ("auto")."""
        # The budget is a share of the memory free at start, so the slots differ per machine: a
        # bucket wider than them is compiled at the slot count, which still holds every step.
        fitted = cfg.buckets_within(self.max_batch)
        over = sorted({batch for batch, _ in cfg.compile_buckets if batch > self.max_batch})
        if over:
            log.warning("engine.compile_buckets batch %s exceeds the %d KV slots of the plan (%s): compiled as "
                        "batch %d", ", ".join(map(str, over)), self.max_batch, self.kv_plan.describe(), self.max_batch)
        kvs = sorted({min(kv, self.cache.capacity) for kv in cfg.compile_kv}) or [self.cache.capacity]
        cf = CompiledForward(self.runner.model, self.cache, batch_buckets={b for b, _ in fitted},
                             width_buckets={w for _, w in fitted}, kv_buckets=kvs, lazy=False,
                             gemm_autotune=cfg.compile_autotune, load_share=cfg.compile_load_share,
                             threads=self.runner.threads)
        buckets = [Bucket(b, w, kv) for b, w in fitted for kv in kvs]
        if cfg.compile_prefill and cf.dynamic and cfg.prefill_chunk > 1:  # after the batch-1 graphs
            buckets.insert(sum(b.batch == 1 for b in buckets), Bucket(1, cfg.prefill_chunk, kvs[-1], prefill=True))
        cf.warmup(buckets) if cfg.compile == "on" else cf.compile_in_background(buckets)
        return cf

    @property
    def compiled(self) -> CompiledForward | None:  # the runner's compiled decode graphs
        return self.runner.graphs

    @property
    def prefill_s(self) -> float:
        """Seconds in prefill forwards."""
        return self.prefiller.seconds

    def compile_status(self) -> list[dict]:
        """The compiled decode buckets (`CompiledForward.status`), each with what steps of its batch
        cost served, per width its graph runs them at, beside what they cost alone where it was
        timed (for /health)."""
        costs, cf = self.runner.costs, self.compiled
        if cf is None:
            return []

        def served(b: dict) -> dict[int, float]:
            own = Bucket(b["batch"], b["width"], b["kv"])
            return {w: round(ms, 3) for w in cf.graph_widths(own)
                    if cf.ready_bucket_for(own.batch, w, min(own.kv, cf.scratch)) == own
                    and (ms := costs.measured(own.batch, w)) is not None}

        return [{**b, "served_ms": {} if b.get("prefill") else served(b)} for b in cf.status()]

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
        # Requests that will get a free slot at the next step are not "waiting"; a burst that
        # arrives between two steps must not be refused while slots are free.
        sched = self.scheduler
        if len(sched.waiting) >= self.config.max_waiting + max(sched.free_slots(), 0):
            raise EngineOverloaded(f"{len(sched.waiting)} requests are already waiting for a slot")
        seq = Sequence.of(req, params, self.runner.layout, self.knowledge)
        self._seqs[req.request_id] = seq
        sched.add(seq)
        if self.compiled is not None:
            self.compiled.busy = True

    def abort(self, seq_id: str | int) -> bool:
        """Stop a request; its slot is freed at once, or at the next step if it is running. False
        if it is unknown or done."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.finished:
            return False
        running = seq in self.scheduler.running
        self._apply(self.scheduler.abort(seq))
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
            self._apply(self.scheduler.abort(seq, reason))
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
        for slot in range(self.max_batch):
            self.cache.lengths[slot] = 0
            self.buffers.reset_slot(slot, 0)
        if self.compiled is not None:
            self.compiled.busy = False

    def queue_depth(self) -> tuple[int, int]:
        """(running, waiting); the sequence being prefilled counts as waiting."""
        s = self.scheduler
        return len(s.running), len(s.waiting) + (s.prefilling is not None)

    def has_work(self) -> bool:
        return bool(len(self.scheduler) or self._finished_early)

    def time_idle(self) -> bool:
        """With no request in, time one compiled graph made ready in the background
        (`CompiledForward.time_pending`) on this thread, as its steps will run; True if one was."""
        return self.compiled is not None and not self.has_work() and self.compiled.time_pending()

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Schedule (retire, admit, prompt chunks of prefill_chunk tokens in all), plan, execute one
        decode forward, update. A prompt a chunk completed has its first token from the prefill and
        decodes from the next step, so that token waits for no decode forward."""
        t0 = time.perf_counter()
        outputs, self._finished_early = self._finished_early, []
        self._retire()
        fresh = self.prefiller.run()
        outputs.extend(fresh)
        decoding = len(self.scheduler.running) - len(fresh)  # the fresh sequences hold the last slots
        if decoding:
            plan = self._plan(decoding)
            pred, logits = self._execute(plan)
            decoded = update(plan, pred, logits, self.cache)
            self.planner.learn([len(out.tokens) for out in decoded])
            outputs.extend(decoded)
        else:
            self.planner.idle()
        self._retire()
        self.steps += 1
        self.step_s += time.perf_counter() - t0
        if self.compiled is not None:
            self.compiled.busy, self.compiled.beat = self.has_work(), self.steps
        return outputs

    def _plan(self, batch: int) -> StepPlan:
        """Each of the first `batch` running requests drafts at the planner's row price, the planner
        picks each kind, and each request writes its span of the step's tokens."""
        sched, ids = self.scheduler, self.buffers.ids
        running = sched.running[:batch]
        waiting = len(sched.waiting) + (sched.prefilling is not None) + len(sched.running) - batch  # the fresh too
        price = self.planner.row_price(len(running) + waiting)
        due = self.planner.drafts_due(len(running) + waiting)
        drafts = [seq.drafter.draft(seq.tokens, price) if seq.drafter is not None and due else None for seq in running]
        choices = self.planner.plan(drafts, price, waiting)
        spans = []
        for b, (seq, draft, choice) in enumerate(zip(running, drafts, choices)):
            if seq.drafter is None or draft is None:
                ids[b, 0] = seq.tokens[-1]
                spans.append(plain_span(seq.layout))
            else:
                spans.append(seq.drafter.write(ids[b], draft, choice, seq.tokens[-1]))
        return StepPlan(running, drafts, spans, max(span.width for span in spans))

    def _execute(self, plan: StepPlan) -> tuple[list[list[int]], torch.Tensor]:
        """The plan's positions and masks into the step buffers, one decode forward; returns the
        argmax of every step row and the logits."""
        buf, cache, lengths = self.buffers, self.cache, self.cache.lengths
        batch, width = plan.batch, plan.width
        for b, (span, draft) in enumerate(zip(plan.spans, plan.drafts)):
            n, start = span.width, lengths[b]
            pos = buf.pos[b]
            np.add(span.offsets[:n], start, out=pos[:n])
            pos[n:width] = start
            np.minimum(pos[:width], self._max_position, out=pos[:width])
            buf.ids[b, n:width] = 0
            np.add(buf.arange[:width], start, out=buf.write_index[b, :width])
            buf.write_block(b, start, span.template[:n, :n], width)
            if draft is not None and (tree := draft.tree).size > 1:
                buf.write_tree(b, span.cand_start, tree.visible[: tree.size, : tree.size])
        buf.to_device(batch, width)
        kv_len = max(lengths[:batch]) + width
        cache.prepare_rows(batch, buf.dev[2, :batch, :width], kv_len)
        t1 = time.perf_counter()
        know = self.knowledge
        succ = know.successors
        tokens, logits = self.runner.decode(buf.dev[0, :batch, :width], buf.dev[1, :batch, :width],
                                            buf.mask[:batch, :, :width, :kv_len], cache,
                                            topk=succ.k if succ is not None else 0)
        self.forward_s += time.perf_counter() - t1
        pred = (tokens[..., 0] if succ is not None else tokens).tolist()
        if succ is not None:
            know.observe_forward(buf.ids, tokens, [span.width for span in plan.spans])
        return pred, logits

    def _retire(self) -> None:
        done, moves = self.scheduler.retire()
        for seq in done:
            self._seqs.pop(seq.seq_id, None)
            if seq.finish_reason is not FinishReason.ABORT:
                self.knowledge.add_finished_text(seq.tokens)
        self._apply(moves)

    def _apply(self, moves: list[SlotMove]) -> None:
        """Carry the scheduler's slot moves out on the KV cache and the step buffers."""
        for move in moves:
            if move.src is None:
                self.cache.lengths[move.dst] = 0
            else:
                self.cache.move_slot(move.src, move.dst)
                self.buffers.reset_slot(move.dst, self.cache.lengths[move.dst])

"""The continuous-batching engine: requests join and leave at any step, one decode forward per step."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.graphs.buckets import Bucket
from lookahead_core.engine.graphs.decode_graphs import DecodeGraphs
from lookahead_core.engine.graphs.package_store import PackageStore
from lookahead_core.engine.planner import StepPlanner
from lookahead_core.engine.prefill import Prefiller
from lookahead_core.engine.request import EngineRequest
from lookahead_core.engine.runner.memory_plan import (
    COMPILE_WORKSPACE_BYTES,
    GRAPH_CODE_BYTES,
    ONEDNN_CACHE_BYTES,
    KVPlan,
    MemoryPlan,
    free_memory,
    plan_kv,
    process_rss,
)
from lookahead_core.engine.runner.model_runner import ModelRunner
from lookahead_core.engine.runner.prefix_cache import PrefixCache
from lookahead_core.engine.scheduler import Scheduler, SlotMove
from lookahead_core.engine.sequence import Sequence
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
        capacity = self.max_seq_len + cfg.max_step_tokens
        chunk = min(cfg.prefill_chunk, self.max_seq_len)  # a prompt is shorter: its masks need no more rows
        budget = cfg.kv_cache_memory
        assert not isinstance(budget, str)  # EngineConfig parses memory strings into bytes
        cpu = r.device.type == "cpu"
        if free_bytes is None and (budget is None or isinstance(budget, float) or cpu):
            free_bytes = free_memory(r.device)
        self.knowledge = ReplicaKnowledge(cfg, r.vocab_size)  # what the replica learns across requests
        process = (process_rss() or 0) if cpu else 0
        beside = self._beside_kv(cfg, cfg.max_batch, capacity, chunk)  # graphs, buffers, compile workers
        if cpu and free_bytes is not None and free_bytes < beside + self.knowledge.planned_bytes:
            no_kv = KVPlan(0, capacity, r.kv_bytes_per_token, 0, None, 0)
            self._memory_plan(process, no_kv, cfg.max_batch, capacity, chunk, self._graph_buckets(
                cfg, cfg.max_batch, capacity, chunk) if cfg.compile != "off" else []).check(free_bytes)
        # the tables live in host memory: on a CPU replica they share the free memory the KV is fitted to
        self.kv_plan: KVPlan = plan_kv(cfg.max_batch, capacity, r.kv_bytes_per_token,
                                       cfg.max_step_tokens * capacity * r.dtype.itemsize, budget,
                                       None if free_bytes is None else max(free_bytes - (beside if cpu else 0), 0),
                                       reserved_tokens=cfg.prefix_cache_tokens,
                                       learned_bytes=self.knowledge.planned_bytes, learned_in_free=cpu)
        self.max_batch = slots = self.kv_plan.slots
        buckets = self._graph_buckets(cfg, slots, capacity, chunk) if cfg.compile != "off" else []
        self.memory = self._memory_plan(process, self.kv_plan, slots, capacity, chunk, buckets)
        if cpu:
            self.memory.check(free_bytes)
        r.allocate(slots, capacity, cfg.max_step_tokens)
        assert r.cache is not None and r.buffers is not None
        self.cache, self.buffers = r.cache, r.buffers
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
        if buckets:
            store = PackageStore(cfg.compile_dir) if cfg.compile_dir else None
            r.build_graphs(buckets, cfg.compile, store, cfg.compile_workers).start()

    def _graph_buckets(self, cfg: EngineConfig, slots: int, capacity: int, chunk: int) -> list[Bucket]:
        """On CPU one decode graph of every batch and width up to compile_max_width, and one for
        prompt chunks (`compile_prefill`); on CUDA the fixed shapes of compile_buckets."""
        if self.runner.device.type == "cpu":
            out = [Bucket(slots, min(cfg.compile_max_width, cfg.max_step_tokens), capacity - 1)]
            if cfg.compile_prefill and chunk > 1:
                out.append(Bucket(1, chunk, capacity - 1, prefill=True))
            return out
        fitted = cfg.buckets_within(slots)
        over = sorted({batch for batch, _ in cfg.compile_buckets if batch > slots})
        if over:
            log.warning("engine.compile_buckets batch %s exceeds the %d KV slots of the plan: compiled as batch %d",
                        ", ".join(map(str, over)), slots, slots)
        kvs = sorted({min(kv, capacity) for kv in cfg.compile_kv}) or [capacity]
        return [Bucket(b, w, kv, dynamic=False) for b, w in fitted for kv in kvs]

    def _beside_kv(self, cfg: EngineConfig, slots: int, capacity: int, chunk: int) -> int:
        """What the graphs, the buffers and the compile workers take beside the KV slots (for a
        fractional KV budget: the share is of the memory free beside them)."""
        no_kv = KVPlan(0, capacity, self.runner.kv_bytes_per_token, 0, None, 0)
        plan = self._memory_plan(0, no_kv, slots, capacity, chunk, self._graph_buckets(cfg, slots, capacity, chunk)
                                 if cfg.compile != "off" else [])
        return plan.beside_kv_bytes

    def _memory_plan(self, process: int, kv: KVPlan, slots: int, capacity: int, chunk: int,
                     buckets: list[Bucket]) -> MemoryPlan:
        r, cfg = self.runner, self.config
        item = r.dtype.itemsize
        buffers = (3 * slots * cfg.max_step_tokens * 8  # step ids, positions, KV columns
                   + chunk * capacity * item + chunk * chunk * item  # the prefill mask and its causal block
                   + sum(b.batch * b.width * (min(b.kv, capacity - 1) * item + 24) for b in buckets))  # graph inputs
        widest = max((b.batch * b.width for b in buckets if not b.prefill), default=slots * cfg.max_step_tokens)
        compiling = r.device.type == "cpu" and cfg.compile != "off"
        return MemoryPlan(process, r.weights.bytes, kv, buffers, self.knowledge.planned_bytes, len(buckets),
                          len(buckets) * GRAPH_CODE_BYTES, widest * r.vocab_size * item,
                          # a worker packs its own uninitialised copy of the weights for oneDNN
                          COMPILE_WORKSPACE_BYTES + (r.weights.bytes if r.weights.layout == "onednn" else 0)
                          if compiling else 0,
                          min(cfg.compile_workers, len(buckets)) if compiling else 0,
                          ONEDNN_CACHE_BYTES if r.weights.layout == "onednn" else 0)

    @property
    def compiled(self) -> DecodeGraphs | None:  # the runner's compiled graphs
        return self.runner.graphs

    @property
    def prefill_s(self) -> float:
        """Seconds in prefill forwards."""
        return self.prefiller.seconds

    def compile_status(self) -> list[dict]:
        """The compiled graphs (`DecodeGraphs.status`), each decode graph with what the steps it
        runs cost served, per "b<batch>t<width>" (for /health)."""
        graphs = self.compiled
        if graphs is None:
            return []
        served = self.runner.costs.table()
        return [{**b, "served_ms": {} if b.get("prefill") else served} for b in graphs.status()]

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

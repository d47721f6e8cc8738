"""The continuous-batching engine: requests join and leave at any step, one decode forward per step."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from lookahead_core.engine.compiled_forward import Bucket, CompiledForward
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.kv_budget import KVPlan, free_memory, plan_kv
from lookahead_core.engine.kv_cache import BatchKVCache
from lookahead_core.engine.logprobs import TokenLogprob, token_logprobs
from lookahead_core.engine.model_runner import ModelRunner
from lookahead_core.engine.planner import StepPlanner
from lookahead_core.engine.prefix_cache import PrefixCache
from lookahead_core.engine.request import EngineRequest
from lookahead_core.engine.scheduler import Scheduler, SlotMove
from lookahead_core.engine.sequence import Row, Sequence, SequenceStats
from lookahead_core.engine.step_buffers import BatchStepBuffers
from lookahead_core.lookahead.knowledge import ReplicaKnowledge
from lookahead_core.lookahead.pacing import StepKind
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams, sample_rows
from lookahead_core.lookahead.stopping import FinishReason

log = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """The waiting queue is full."""


@dataclass
class StepOutput:
    """One request's share of a step: the tokens it accepted, what kind of row it ran and how
    wide; on its last output the finish reason and the request's `SequenceStats`."""

    seq_id: str | int
    tokens: list[int]
    finish_reason: FinishReason | None = None
    kind: StepKind | None = None
    width: int = 0
    stats: SequenceStats | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first output; the first token has none
    sources: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # tree rows by `Source`: (proposed, accepted)


class Engine:
    """Synchronous engine: `add_request`, `step`, `abort`, `queue_depth`.

    Each step runs at most one prefill chunk (for the sequence being admitted) and one decode
    forward over every running sequence, each with its own row, padded to the widest. The
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
        self.planner = StepPlanner(r.costs, slots, cfg.slo_tpot_ms)
        self.prefixes = PrefixCache(cfg.prefix_cache_tokens) if cfg.prefix_cache_tokens else None
        self._prefill_mask = torch.zeros((1, 1, chunk, capacity), dtype=r.dtype, device=r.device)
        self._causal = torch.full((chunk, chunk), torch.finfo(r.dtype).min, dtype=r.dtype, device=r.device).triu_(1)
        self._max_position = (ctx or np.iinfo(np.int64).max) - 1
        self._seqs: dict[str | int, Sequence] = {}
        self._finished_early: list[StepOutput] = []
        self.forward_s = 0.0  # decode forwards
        self.prefill_s = 0.0
        self.step_s = 0.0  # whole steps, prefill included
        self.steps = 0  # lifetime counters, for health and leak checks
        self.aborted = 0
        self.compiled = self._compiled_forward(cfg) if cfg.compile != "off" else None

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
        capacity = self.cache.capacity
        kvs = sorted({min(kv, capacity) for kv in cfg.compile_kv})
        cf = CompiledForward(self.runner.model, self.cache, batch_buckets={b for b, _ in fitted},
                             width_buckets={w for _, w in fitted}, kv_buckets=kvs, lazy=False,
                             gemm_autotune=cfg.compile_autotune, load_share=cfg.compile_load_share)
        buckets = [Bucket(b, w, kv) for b, w in fitted for kv in kvs]
        if cfg.compile == "on":
            for bucket, seconds in cf.warmup(buckets).items():
                log.warning("compiled decode bucket %s in %.1f s", bucket, seconds)
        else:
            cf.compile_in_background(buckets)
        return cf

    def compile_status(self) -> list[dict]:
        """The compiled decode buckets: shape, ready or not, compile seconds, steps run, and what the
        graph cost alone beside what steps of its batch and width cost served (for /health)."""
        if self.compiled is None:
            return []
        costs = self.runner.costs
        return [{**b, "served_ms": None if (ms := costs.measured(b["batch"], b["width"])) is None else round(ms, 3)}
                for b in self.compiled.status()]

    # ---- requests -------------------------------------------------------------------------

    def resolve(self, req: EngineRequest) -> LookaheadParams | None:
        """The (N, W, G) a request runs: its own, the engine's for "auto", None for "off"."""
        if req.lookahead == "off":
            return None
        params = self.config.lookahead if req.lookahead == "auto" else req.lookahead
        self.config.check_params(params)
        return params

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
        self.runner.check_tokens(req.prompt)
        top = max(req.logprobs or 0, req.prompt_logprobs or 0)
        if top > self.runner.vocab_size:
            raise ValueError(f"{top} logprobs per token exceed the model's vocabulary of {self.runner.vocab_size} tokens")
        # Requests that will get a free slot at the next step are not "waiting"; a burst that
        # arrives between two steps must not be refused while slots are free.
        sched = self.scheduler
        if len(sched.waiting) >= self.config.max_waiting + max(sched.free_slots(), 0):
            raise EngineOverloaded(f"{len(sched.waiting)} requests are already waiting for a slot")
        seq = Sequence(req, params, self.runner.layout, self.knowledge)
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

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        outputs, self._finished_early = self._finished_early, []
        self._retire()
        # Admit while the next prompt needs no prefill forward (one token, or a stored prefix);
        # at most one chunk runs.
        while (job := self.scheduler.next_prefill()) is not None:
            if job[1] == 0 and self._reuse_prefix(job[0]):
                continue
            self._prefill(*job)
            if job[2] > 0:
                break
        if self.scheduler.running:
            outputs.extend(self._decode())
            self._retire()
        self.steps += 1
        self.step_s += time.perf_counter() - t0
        if self.compiled is not None:
            self.compiled.busy, self.compiled.beat = self.has_work(), self.steps
        return outputs

    def _prefill(self, seq: Sequence, start: int, n: int) -> None:
        slot = seq.slot
        assert slot is not None  # the scheduler admitted it into a slot
        t0 = time.perf_counter()
        if n > 0:
            ids = torch.tensor([seq.tokens[start : start + n]], dtype=torch.long, device=self.runner.device)
            m = self._prefill_mask[0, 0]
            m[:n, start : start + n].copy_(self._causal[:n, :n])
            self.cache.prepare_slot(slot, start, n)
            top = seq.prompt_logprobs
            succ = self.knowledge.successors if self.config.successor_prefill else None
            logits = self.runner.prefill(ids, start, self.cache, self._prefill_mask[:, :, :n, : start + n],
                                         all_logits=top is not None or succ is not None, compiled=self.compiled)
            if succ is not None:  # the prompt's own tokens get the successors the model gives them here
                self.knowledge.observe_prefill(ids[0].cpu().numpy(), logits[0].topk(succ.k, dim=-1).indices.cpu().numpy())
            m[:n, start : start + n].zero_()
            if top is not None and seq.prompt_lp is not None:  # row i predicts prompt token start + i + 1
                seq.prompt_lp += token_logprobs(logits[0], range(n), seq.tokens[start + 1 : start + n + 1], top)
        self.prefill_s += time.perf_counter() - t0
        self._prefilled(seq, slot, start + n, n)

    def _reuse_prefix(self, seq: Sequence) -> bool:
        """Copy the longest stored prefix of a newly admitted prompt into its slot; True if any.
        Not for requests that want the prompt's logprobs (a copied prefix has no logits)."""
        if self.prefixes is None or seq.prompt_logprobs is not None or self.config.successor_prefill:
            return False
        assert seq.slot is not None  # admitted into a slot
        reused = self.prefixes.load(seq.tokens[: seq.prompt_len - 1], self.cache, seq.slot)
        if reused:
            self._prefilled(seq, seq.slot, reused, reused)
        return reused > 0

    def _prefilled(self, seq: Sequence, slot: int, length: int, tokens: int) -> None:
        """`tokens` more of the prompt are in the slot, `length` in all; a prompt now whole starts decoding."""
        self.cache.lengths[slot] = length
        if self.scheduler.prefill_done(tokens) is not None:
            self.buffers.reset_slot(slot, length)
            if self.prefixes is not None and length == seq.prompt_len - 1:
                self.prefixes.store(seq.tokens[:length], self.cache, slot)

    def _decode(self) -> list[StepOutput]:
        sched = self.scheduler
        running = sched.running
        buf, cache, lengths = self.buffers, self.cache, self.cache.lengths
        batch = len(running)
        waiting = len(sched.waiting) + (sched.prefilling is not None)
        price = self.planner.row_price(batch + waiting)
        choices = self.planner.plan([seq.offer(price) for seq in running], waiting)
        rows = [seq.plan(buf.ids[b], choice) for b, (seq, choice) in enumerate(zip(running, choices))]
        widths = [row.width for row in rows]
        width = max(widths)
        for b, (seq, row) in enumerate(zip(running, rows)):
            n, start = row.width, lengths[b]
            pos = buf.pos[b]
            np.add(row.offsets[:n], start, out=pos[:n])
            pos[n:width] = start
            np.minimum(pos[:width], self._max_position, out=pos[:width])
            buf.ids[b, n:width] = 0
            np.add(buf.arange[:width], start, out=buf.write_index[b, :width])
            buf.write_block(b, start, row.template[:n, :n], width)
            tree = seq.tree
            if tree.size > 1:
                buf.write_tree(b, row.cand_start, tree.visible[: tree.size, : tree.size])
        buf.to_device(batch, width)
        kv_len = max(lengths[:batch]) + width
        cache.prepare_rows(batch, buf.dev[2, :batch, :width], kv_len)
        t1 = time.perf_counter()
        know = self.knowledge
        succ = know.successors
        tokens, logits = self.runner.forward(buf.dev[0, :batch, :width], buf.dev[1, :batch, :width],
                                             buf.mask[:batch, :, :width, :kv_len], cache, self.compiled,
                                             topk=succ.k if succ is not None else 0)
        self.forward_s += time.perf_counter() - t1
        pred = (tokens[..., 0] if succ is not None else tokens).tolist()
        if succ is not None:
            know.observe_forward(buf.ids, tokens, widths)

        drawn = self._draw(running, rows, logits)
        outputs: list[StepOutput] = []
        slots: list[int] = []
        src: list[int] = []
        dst: list[int] = []
        for b, (seq, row) in enumerate(zip(running, rows)):
            accepted_rows, accepted = seq.accept(pred[b], row, drawn.get(b))
            start = lengths[b]
            if accepted_rows:  # the accepted candidate's rows move right behind the last token
                slots.extend([b] * len(accepted_rows))
                src.extend(start + r for r in accepted_rows)
                dst.extend(range(start + 1, start + 1 + len(accepted_rows)))
            lengths[b] = start + len(accepted)
            out = StepOutput(seq.seq_id, accepted, seq.finish_reason, row.choice.kind, row.width,
                             seq.stats if seq.finished else None, sources=seq.step_sources)
            if seq.logprobs is not None:
                out.logprobs = token_logprobs(logits[b], [0, *accepted_rows], accepted, seq.logprobs)
            if seq.prompt_lp is not None:
                out.prompt_logprobs, seq.prompt_lp = seq.prompt_lp, None
            outputs.append(out)
        if slots:
            cache.move_entries(slots, src, dst)
        return outputs

    @staticmethod
    def _draw(running: list[Sequence], rows: list[Row], logits: torch.Tensor) -> dict[int, dict[int, int]]:
        """Sampled requests' tokens along their walks: {batch row: {step row: token}}. Level by
        level, each request's next row is drawn for all of them at once per sampling setting (one
        transfer each); a row is drawn only once the walk reaches it, as plain sampling would."""
        sampled = [b for b, seq in enumerate(running) if seq.sampled]
        drawn: dict[int, dict[int, int]] = {b: {} for b in sampled}
        todo = [(b, 0, running[b].first_draw()) for b in sampled]
        while todo:
            groups: dict[SamplingParams, list[tuple[int, int, float]]] = {}
            for b, at, u in todo:  # one group per warp (`Sequence.sampling` holds no seed)
                warp = running[b].sampling
                assert warp is not None
                groups.setdefault(warp, []).append((b, at, u))
            todo = []
            for params, members in groups.items():
                index_b = torch.tensor([b for b, _, _ in members], device=logits.device)
                index_t = torch.tensor([at for _, at, _ in members], device=logits.device)
                tokens = sample_rows(logits[index_b, index_t], params, [u for _, _, u in members])
                for (b, at, _), token in zip(members, tokens):
                    drawn[b][at] = token
                    if (nxt := running[b].next_draw(rows[b], at, token)) is not None:
                        todo.append((b, *nxt))
        return drawn

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

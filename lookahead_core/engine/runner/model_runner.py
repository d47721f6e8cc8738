"""The owner of the model, its one copy of the weights, the KV slots, the step buffers and the
compiled graphs; every forward of the engine goes through it."""
from __future__ import annotations

import inspect
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lookahead_core.engine.graphs.buckets import Bucket, powers_of_two
from lookahead_core.engine.graphs.decode_graphs import DecodeGraphs
from lookahead_core.engine.graphs.package_store import PackageStore
from lookahead_core.engine.runner.kv_cache import BatchKVCache
from lookahead_core.engine.runner.memory_plan import release_freed_memory
from lookahead_core.engine.runner.prefix_cache import PrefixCache
from lookahead_core.engine.runner.step_buffers import BatchStepBuffers
from lookahead_core.engine.runner.step_threads import StepThreads
from lookahead_core.engine.runner.weights import WeightLayout, WeightsInfo, apply_layout, resolve_layout
from lookahead_core.engine.step.planner import StepPlan
from lookahead_core.engine.step.prices import StepCosts
from lookahead_core.engine.step.scheduler import PrefillJob, SlotMove
from lookahead_core.lookahead.layout import StepLayout
from lookahead_core.lookahead.params import LookaheadParams


class ModelRunner:
    """Holds a causal LM, lays its weights out once for every forward (`weights`), and calls it
    with explicit positions, a 4D float mask and a cache: in the compiled graph that holds a step
    (`graphs`, once built), else eagerly. Learns what its decode forwards cost (`costs`)."""

    def __init__(self, model: torch.nn.Module, costs: StepCosts | None = None, max_layouts: int = 32,
                 threads: StepThreads | None = None, weight_layout: WeightLayout = "auto") -> None:
        self.model = model
        self.costs = costs or StepCosts()
        self.threads = threads  # torch threads per forward by its batch; None: the process's, untouched
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.weights: WeightsInfo = apply_layout(model, resolve_layout(weight_layout, self.device, self.dtype))
        release_freed_memory()
        self.graphs: DecodeGraphs | None = None
        self.cache: BatchKVCache | None = None
        self.buffers: BatchStepBuffers | None = None
        self.prefixes: PrefixCache | None = None
        self.decode_s = 0.0  # in decode forwards (`decode_plan`)
        self.eager_forwards = 0  # decode forwards no graph held (or whose graph raised)
        self._forwards_since_trim = False
        self._graph_changes = -1
        config: Any = model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = int(config.num_hidden_layers)
        self.vocab_size = int(config.vocab_size)
        self.context_length = getattr(config, "max_position_embeddings", None)
        heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        self.kv_bytes_per_token = self.num_layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize
        self.sliding_window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.generation_config = getattr(model, "generation_config", None)
        # Clients choose (N, W, G) per request, so the layouts kept are bounded (least recently used out).
        self._layouts: OrderedDict[LookaheadParams | None, StepLayout] = OrderedDict()
        self.max_layouts = max_layouts

    # ---- memory the runner owns ------------------------------------------------------------------

    def allocate(self, slots: int, capacity: int, max_step_tokens: int, prefill_chunk: int = 1,
                 prefix_tokens: int = 0) -> None:
        """The KV slots, the step buffers and the prefix cache (`prefix_tokens`, 0: none), once."""
        self.cache = BatchKVCache(self.num_layers, slots, capacity, self.device)
        self.cache.allocate(self.kv_heads, self.head_dim, self.dtype)
        self.buffers = BatchStepBuffers(slots, max_step_tokens, capacity, self.dtype, self.device, prefill_chunk)
        self.prefixes = PrefixCache(prefix_tokens) if prefix_tokens else None

    def build_graphs(self, buckets: Sequence[Bucket], mode: str, store: PackageStore | None = None,
                     workers: int = 1) -> DecodeGraphs:
        """The compiled graphs over this runner's weights and KV slots (`allocate` first); `start`
        makes them ready."""
        assert self.cache is not None, "allocate the KV slots first"
        self.graphs = DecodeGraphs(self.model, self.cache.slot_tensors(), self.cache.capacity, buckets, mode=mode,
                                   store=store, layout=self.weights.layout, threads=self.threads, workers=workers)
        return self.graphs

    # ---- requests' checks and layouts ------------------------------------------------------------

    def layout(self, params: LookaheadParams | None) -> StepLayout:
        """The step layout for `params`, built once per (N, W, G, tree rows) on this model's dtype and
        device while in use; a sequence keeps its own reference."""
        key = None if params is None else LookaheadParams(params.n, params.w, params.g, lookup=params.lookup,
                                                          successors=params.successors)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = StepLayout(key, self.dtype, self.device)
            while len(self._layouts) > self.max_layouts:
                self._layouts.popitem(last=False)
        self._layouts.move_to_end(key)
        return lay

    def check_tokens(self, tokens: Sequence[int], top_logprobs: int = 0) -> None:
        """Token ids, and the logprobs asked per token, within the vocabulary."""
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {self.vocab_size})")
        if top_logprobs > self.vocab_size:
            raise ValueError(f"{top_logprobs} logprobs per token exceed the model's vocabulary of {self.vocab_size} tokens")

    def check_length(self, total_tokens: int) -> None:
        if self.context_length is not None and total_tokens > self.context_length:
            raise ValueError(
                f"prompt plus max_new_tokens is {total_tokens} tokens, beyond the model's context "
                f"length of {self.context_length}"
            )
        if self.sliding_window is not None and total_tokens > self.sliding_window:
            raise ValueError(
                f"prompt plus max_new_tokens is {total_tokens} tokens, beyond the model's sliding "
                f"window of {self.sliding_window}; sliding-window masks are not supported yet"
            )

    # ---- the step's KV and buffers: their lengths and moves are written here only -----------------

    def apply(self, moves: Sequence[SlotMove]) -> None:
        """Carry the scheduler's slot moves out on the KV slots and the step buffers."""
        assert self.cache is not None and self.buffers is not None
        for move in moves:
            if move.src is None:
                self.cache.lengths[move.dst] = 0
            else:
                self.cache.move_slot(move.src, move.dst)
                self.buffers.reset_slot(move.dst, self.cache.lengths[move.dst])

    def reset(self) -> None:
        """Every slot empty (after a failed step)."""
        assert self.cache is not None and self.buffers is not None
        for slot in range(len(self.cache.lengths)):
            self.cache.lengths[slot] = 0
            self.buffers.reset_slot(slot, 0)

    def prefix_match(self, prompt: Sequence[int]) -> int:
        """The tokens of `prompt` a stored prefix holds (0: none)."""
        return 0 if self.prefixes is None else self.prefixes.match(prompt)

    def prefill_jobs(self, jobs: Sequence[PrefillJob], all_logits: Sequence[bool]) -> list[torch.Tensor]:
        """Each job's stored prefix copied in and its chunk's forward: logits [1, T', V] per job, every
        row's where `all_logits` says, else the last's. A prompt a job completes is stored in the
        prefix cache once every job ran (a store may evict a prefix a later job copies)."""
        cache, buf = self.cache, self.buffers
        assert cache is not None and buf is not None
        out = []
        for job, every in zip(jobs, all_logits):
            seq, slot, start, n = job.seq, job.slot, job.start, job.tokens
            if job.reused and job.sibling is not None:  # a choice of the same request holds the prompt
                cache.copy_prefix(job.sibling, slot, job.reused)
            elif job.reused:
                assert self.prefixes is not None
                self.prefixes.copy_in(seq.tokens[: seq.prompt_len - 1], cache, slot, job.reused)
            ids = torch.tensor([seq.tokens[start : start + n]], dtype=torch.long, device=self.device)
            cache.prepare_slot(slot, start, n)
            out.append(self.prefill(ids, start, cache, buf.chunk_mask(start, n), all_logits=every))
            buf.clear_chunk(start, n)
            cache.lengths[slot] = start + n
            if job.last:
                buf.reset_slot(slot, start + n)
        for job in jobs:
            if job.last and job.sibling is None and self.prefixes is not None:  # each prompt but its last token
                self.prefixes.store(job.seq.tokens[: job.seq.prompt_len - 1], cache, job.slot)
        return out

    def decode_plan(self, plan: StepPlan, max_position: int, topk: int = 0) -> tuple[np.ndarray, torch.Tensor]:
        """The plan staged into the step buffers and its one decode forward (`decode`)."""
        cache, buf = self.cache, self.buffers
        assert cache is not None and buf is not None
        batch, width = plan.batch, plan.width
        buf.stage(plan, cache.lengths, max_position)
        kv_len = max(cache.lengths[:batch]) + width
        cache.prepare_rows(batch, buf.dev[2, :batch, :width], kv_len)
        t0 = time.perf_counter()
        out = self.decode(buf.dev[0, :batch, :width], buf.dev[1, :batch, :width], buf.mask[:batch, :, :width, :kv_len],
                          cache, topk)
        self.decode_s += time.perf_counter() - t0
        return out

    def commit(self, accepted: Sequence[int], kept_rows: Sequence[Sequence[int]]) -> None:
        """After a decode step: slot b's length grows by its `accepted[b]` tokens, and the keys and
        values of its `kept_rows[b]` (the accepted candidate's step rows) move right behind its last
        token."""
        cache = self.cache
        assert cache is not None
        lengths = cache.lengths
        slots: list[int] = []
        src: list[int] = []
        dst: list[int] = []
        for b, (n, rows) in enumerate(zip(accepted, kept_rows)):
            start = lengths[b]
            if rows:
                slots.extend([b] * len(rows))
                src.extend(start + r for r in rows)
                dst.extend(range(start + 1, start + 1 + len(rows)))
            lengths[b] = start + n
        if slots:
            cache.move_entries(slots, src, dst)

    # ---- forwards ----------------------------------------------------------------------------------

    def _eager(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None, cache,
               logits_to_keep: int | None = None) -> torch.Tensor:
        """The one uncompiled forward: logits [B, T', V]."""
        kwargs = {"logits_to_keep": logits_to_keep} if logits_to_keep is not None and self._takes_logits_to_keep else {}
        return self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, past_key_values=cache,
                          use_cache=True, **kwargs).logits

    def sync_graphs(self) -> None:
        """Take graphs made ready in the background; where the graphs changed (ready, dropped or
        timed), the batches they run restart their costs, priced by what the graphs cost alone."""
        graphs = self.graphs
        if graphs is None:
            return
        before = set(graphs.ready)
        graphs.poll()
        for changed in before ^ graphs.ready:
            for batch in powers_of_two(changed.batch):
                self.costs.forget(batch)
        if graphs.changes != self._graph_changes:
            self._graph_changes = graphs.changes
            self.costs.calibrate(graphs.alone_costs())

    def prefill(self, input_ids: torch.Tensor, start: int, cache, mask: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Write the keys of `input_ids` [B, T] at positions start.. into the cache; logits [B, T', V]
        whose last row follows the last token (every row with `all_logits`, for prompt logprobs).
        Without `mask` the model applies its causal mask. A chunk a ready graph holds runs in it:
        the prefill graph (the last row's logits), else, for the cache's first slot, the decode
        graph (every row's, which `all_logits` needs)."""
        positions = torch.arange(start, start + input_ids.shape[1], device=self.device).unsqueeze(0)
        self._forwards_since_trim = True
        if self.threads is not None:
            self.threads.use(input_ids.shape[0], prefill=True)
        graphs = self.graphs
        if graphs is not None and mask is not None and input_ids.shape[0] == 1:
            self.sync_graphs()
            width, kv_len = input_ids.shape[1], mask.shape[-1]
            bucket = None if all_logits else graphs.can_prefill(width, kv_len, cache)
            if bucket is None and cache.rows == (0, 1):
                bucket = graphs.can_run(1, width, kv_len, cache)
            out = None if bucket is None else graphs.replay(bucket, input_ids, positions, mask, cache)
            if out is not None:
                return out[1]
        return self._eager(input_ids, positions, mask, cache, 0 if all_logits else 1)

    def decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache,
               topk: int = 0) -> tuple[np.ndarray, torch.Tensor]:
        """(greedy next token after every input position [B, T], then with `topk` its k likeliest
        [B, T, 1 + k]; logits [B, T, V]). The tokens reach the host in one transfer, the step's one
        sync; sampling reads the logits rows it needs. In the graph that holds the step, else
        eagerly; a graph that raises is dropped and the step runs eagerly."""
        self.sync_graphs()
        self._forwards_since_trim = True
        if self.threads is not None:
            self.threads.use(input_ids.shape[0])
        t0 = time.perf_counter()
        out = None
        graphs = self.graphs
        if graphs is not None:
            bucket = graphs.can_run(input_ids.shape[0], input_ids.shape[1], mask.shape[-1], cache)
            out = None if bucket is None else graphs.replay(bucket, input_ids, position_ids, mask, cache)
        if out is None:
            self.eager_forwards += 1
            logits = self._eager(input_ids, position_ids, mask, cache)
            out = logits.argmax(dim=-1), logits
        pred, logits = out
        if topk:  # argmax stays the greedy token: topk's order among equal logits is not argmax's
            pred = torch.cat([pred.unsqueeze(-1), logits.topk(topk, dim=-1, sorted=True).indices], dim=-1)
        tokens = pred.cpu().numpy()
        self.costs.observe(input_ids.shape[0], input_ids.shape[1], (time.perf_counter() - t0) * 1000.0)
        return tokens, logits

    def close(self) -> None:
        """Stop making graphs ready (a compile under way is ended)."""
        if self.graphs is not None:
            self.graphs.close()

    def idle_turn(self, pending=lambda: False) -> bool:
        """With no request in: time one call of a ready graph alone on this thread (the engine's),
        as its steps will run (True: one ran); once that is done, hand the heap pages the forwards
        since the last idle turn freed back to the OS (glibc keeps freed step outputs resident,
        and the process would hold its busiest moment's working set for good)."""
        if self.graphs is not None:
            self.sync_graphs()
            if self.graphs.time_pending(pending):
                return True
        if self._forwards_since_trim:
            self._forwards_since_trim = False
            release_freed_memory()
        return False

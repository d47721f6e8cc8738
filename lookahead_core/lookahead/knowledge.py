"""What a replica has learned across requests: the tables that draft for every request, in one owner."""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from lookahead_core.lookahead.history import SharedHistory
from lookahead_core.lookahead.pacing import FullYields, YieldBias
from lookahead_core.lookahead.row_rates import RowRates
from lookahead_core.lookahead.shared_pool import SharedNGramPool
from lookahead_core.lookahead.successors import SuccessorTable
from lookahead_core.lookahead.tree import SOURCE_NAMES

ROW_DEPTHS = 16  # row rates are kept per depth up to this; deeper rows share the last


class KnowledgeConfig(Protocol):
    """The sizes of the tables (`EngineConfig` has them; 0 turns a table off)."""

    @property
    def shared_pool_cap(self) -> int: ...
    @property
    def shared_pool_keys(self) -> int: ...
    @property
    def shared_pool_text(self) -> int: ...
    @property
    def history_tokens(self) -> int: ...
    @property
    def successor_topk(self) -> int: ...
    @property
    def max_successors(self) -> int: ...
    @property
    def max_n(self) -> int: ...


class KnowledgeSnapshot:
    """Opaque: what `ReplicaKnowledge.snapshot` saw, for `restore`."""

    __slots__ = ("_tables",)

    def __init__(self, tables: tuple) -> None:
        self._tables = tables


class ReplicaKnowledge:
    """The replica's cross-request drafting state: the shared n-gram pool, the history of finished
    text, the successor table (None where the config turns them off), row rates by `sampled` and
    full-step yields. What it holds changes a request's speed, never its tokens.

    Requests hold these tables themselves (no lookup through here on a step), so the tables are
    never replaced: `restore` and `clear` write into them.
    """

    def __init__(self, config: KnowledgeConfig, vocab_size: int) -> None:
        cfg = config
        self.shared_pool = (SharedNGramPool(cfg.shared_pool_cap, cfg.shared_pool_keys, cfg.shared_pool_text)
                            if cfg.shared_pool_cap else None)
        self.history = SharedHistory(cfg.history_tokens) if cfg.history_tokens else None
        self.successors = (SuccessorTable(vocab_size, cfg.successor_topk, max(cfg.max_successors, 1))
                           if cfg.successor_topk else None)
        # greedy and sampled requests apart: a sampled one accepts a row only where its draw lands
        self.row_rates = {sampled: RowRates(ROW_DEPTHS) for sampled in (False, True)}
        self.full_yields = FullYields()
        self.yield_bias = YieldBias()  # how far wide steps fall short of what their plans expected
        self._text_tail = cfg.shared_pool_text  # the history gets as much of a finished text as the pool
        # the arrays are allocated here; the pool grows to its bound as requests of each n finish
        self.planned_bytes = sum(t.nbytes for t in (self.history, self.successors, *self.row_rates.values())
                                 if t is not None)
        if self.shared_pool is not None:
            self.planned_bytes += self.shared_pool.bytes_bound(range(2, cfg.max_n + 1), vocab_size)

    def _tables(self) -> tuple:
        return (self.shared_pool, self.history, self.successors, self.row_rates[False], self.row_rates[True],
                self.full_yields, self.yield_bias)

    # ---- learning -------------------------------------------------------------------------

    def add_finished_text(self, tokens: Sequence[int]) -> None:
        """A finished (not aborted) request's prompt and output."""
        if self.shared_pool is not None:
            self.shared_pool.add_text(tokens)
        if self.history is not None:
            self.history.add_text(tokens[-self._text_tail :])

    def observe_forward(self, ids: np.ndarray, tokens: np.ndarray, widths: list[int]) -> None:
        """A decode step's rows: `ids` [B, W] its inputs, `tokens` [B, W, 1 + k] the model's
        greedy token then its top-k after each; the first `widths[b]` of row b are real. Every
        real row's top-k become its input token's successors."""
        succ = self.successors
        if succ is not None:
            for b, n in enumerate(widths):
                succ.update(ids[b, :n], tokens[b, :n, 1:])

    def observe_prefill(self, ids: np.ndarray, topk: np.ndarray) -> None:
        """Prompt tokens `ids` [T] and the model's top-k after each, [T, k]."""
        if self.successors is not None:
            self.successors.update(ids, topk)

    # ---- the whole of it ------------------------------------------------------------------

    def clear(self) -> None:
        """Forget everything learned: the tables empty, the rates and yields back at their priors."""
        for table in self._tables():
            if table is not None:
                table.clear()

    def snapshot(self) -> KnowledgeSnapshot:
        return KnowledgeSnapshot(copy.deepcopy(self._tables()))

    def restore(self, snapshot: KnowledgeSnapshot) -> None:
        """Back to what `snapshot` saw; the snapshot stays valid for another restore."""
        saved = copy.deepcopy(snapshot._tables)
        live = self._tables()
        if [type(t) for t in saved] != [type(t) for t in live]:
            raise ValueError("the snapshot is of a knowledge with other tables turned on")
        for table, state in zip(live, saved):
            if table is not None:  # in place: requests and pacers hold these very objects
                table.__dict__.clear()
                table.__dict__.update(state.__dict__)

    def status(self) -> dict:
        """The tables' sizes, memory and rates (for /health)."""
        pool, succ, hist = self.shared_pool, self.successors, self.history
        return {
            "planned_bytes": self.planned_bytes,  # what the tables can grow to, counted in the memory plan
            "shared_pool": None if pool is None else {"ngrams": len(pool), "max_keys": pool.max_keys, "cap": pool.cap},
            "text": None if hist is None else {"tokens": min(hist.written, hist.capacity), "capacity": hist.capacity,
                                               "index_entries": len(hist), "bytes": hist.nbytes},
            "successors": None if succ is None else {
                "k": succ.k, "tokens_known": succ.known, "bytes": succ.nbytes, "template_nodes": succ.max_nodes,
                "node_acceptance": {kind: [round(float(r), 3) for r in succ.rates(sampled)[:8]]
                                    for kind, sampled in (("greedy", False), ("sampled", True))}},
            # tree rows accepted per proposal, by source, at depths 1-4 (what a VERIFY step expects of them)
            "row_acceptance": {kind: {name: [round(float(r), 3) for r in rates[:4]]
                                      for name, rates in zip(SOURCE_NAMES, self.row_rates[sampled].rates())}
                               for kind, sampled in (("greedy", False), ("sampled", True))},
            # tokens a whole step (window and tree) yields, where each new request's pacer starts
            "full_step_yield": {("sampled" if sampled else "greedy") + ("_copied" if copied else ""): round(mean, 3)
                                for (sampled, copied), mean in self.full_yields.means.items()},
            # what wide steps' extra tokens came to against their plans' estimate (the planner discounts by it)
            "yield_bias": round(self.yield_bias.factor, 3),
        }

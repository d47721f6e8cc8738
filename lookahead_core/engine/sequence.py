"""One request's decoding state: tokens, lookahead window and pool, stop rule and figures."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from lookahead_core.engine.request import EngineRequest
from lookahead_core.engine.sequence_stats import SequenceStats
from lookahead_core.lookahead.knowledge import ROW_DEPTHS, ReplicaKnowledge
from lookahead_core.lookahead.layout import StepLayout
from lookahead_core.lookahead.ngram_pool import NGramPool
from lookahead_core.lookahead.pacing import Menu, StepChoice, StepKind, StepPacer, step_menu
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.row_rates import RowRates
from lookahead_core.lookahead.sampling import new_seed
from lookahead_core.lookahead.stopping import FinishReason
from lookahead_core.lookahead.suffix_index import SuffixIndex
from lookahead_core.lookahead.tree import CandidateTree, Source
from lookahead_core.lookahead.window import LookaheadWindow


@dataclass(frozen=True)
class Offer:
    """What a request offers the step planner: a menu of kinds it paces over (`pacer`), or one
    width it takes (plain, or a fixed (N, W, G) with its menu for when the SLO rules that out)."""

    width: int
    menu: Menu | None = None
    pacer: StepPacer | None = None
    copied: bool = False


@dataclass(frozen=True)
class Row:
    """One request's row of a step: its width, where the tree starts, positions and mask template."""

    choice: StepChoice
    width: int
    cand_start: int
    offsets: np.ndarray
    template: torch.Tensor


class Sequence:
    """Plans the step rows of one request and takes the model's outputs for them.

    The last accepted token is never in the KV cache: each step feeds it first. Verification
    candidates come, in order of priority, from prompt lookup over the request's own text (or, if
    it has no match, over the replica's `history` of finished requests), its n-gram pool (Jacobi
    window and text), the replica's `shared` pool for the slots left and a
    tree expanded from the last token through the replica's `successors` table, merged into one
    prefix tree. Sampled requests draw output position p with the uniform
    u(seed, p), so in float32 their text depends on the seed alone (lookahead/sampling.py).
    """

    def __init__(
        self,
        req: EngineRequest,
        params: LookaheadParams | None,
        layout_for: Callable[[LookaheadParams | None], StepLayout],
        knowledge: ReplicaKnowledge | None = None,
    ) -> None:
        self.seq_id = req.request_id
        self.tokens: list[int] = list(req.prompt)
        self.prompt_len = len(self.tokens)
        self.stop = req.stop
        self.finish_reason: FinishReason | None = None
        self.slot: int | None = None  # the KV slot, owned by the scheduler
        self.stats = SequenceStats(self.prompt_len)
        self.logprobs, self.prompt_logprobs = req.logprobs, req.prompt_logprobs
        self.prompt_lp: list | None = [None] if req.prompt_logprobs is not None else None
        sampling = req.sampling if req.sampling is not None and not req.sampling.greedy else None
        self.seed = (sampling.seed if sampling.seed is not None else new_seed()) if sampling is not None else None
        # the warp alone: the seed lives in the uniforms, so requests that warp alike draw together
        self.sampling = dataclasses.replace(sampling, seed=None) if sampling is not None else None
        self.params = params
        self.layout = lay = layout_for(params)
        # Step positions: the layout's for the last token and window, tree depths after them;
        # or, on a step without the window, tree depths right after the last token.
        self._full_offsets = lay.offsets.copy()
        self._verify_offsets = np.zeros(1 + lay.max_tree_rows, dtype=np.int64)
        self.tree = CandidateTree(lay.max_tree_rows)
        self._hit = np.zeros(lay.max_tree_rows, dtype=bool)  # which tree rows a step accepted, reused
        self.pacer: StepPacer | None = None
        # the replica's tables, held here so that a step reads them without a lookup through `knowledge`
        know = knowledge
        self._full_yields = full_yields = know.full_yields if know is not None else None
        sampled = sampling is not None
        if params is not None and params.adapt:
            self.pacer = (StepPacer() if full_yields is None else
                          StepPacer(full_yields.start(sampled), on_full=partial(full_yields.observe, sampled)))
        self.shared = shared = know.shared_pool if know is not None else None
        self.history = know.history if know is not None and params is not None and params.lookup else None
        self.successors = know.successors if know is not None and params is not None and params.successors else None
        # how often rows like the tree's were accepted: the replica's (for greedy or sampled
        # requests, as this one is), and this request's own
        self.row_rates = know.row_rates[sampled] if know is not None else RowRates(ROW_DEPTHS)
        self._own_rates = RowRates(self.row_rates.max_depth, prior=False)
        self._order = np.zeros(0, dtype=np.int64)  # tree rows, likeliest first
        self._full_rows = 0  # the tree rows a whole step keeps
        # the last step's tree rows by source: (proposed, accepted), None for a plain step
        self.step_sources: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        if self.successors is not None:  # this request's own acceptance of each successor template node
            self._node_proposed = np.zeros(self.successors.max_nodes)
            self._node_accepted = np.zeros(self.successors.max_nodes)
        if params is not None:
            self.window = LookaheadWindow(params.n, params.w, self.tokens)
            self.pool = NGramPool(params.n, params.g)
            if params.pool_from_prompt:
                self.pool.add_sequence(self.tokens)
            self.suffix = SuffixIndex(params.lookup_match) if params.lookup else None
            if self.suffix is not None:
                self.suffix.extend(self.tokens)
            if shared is not None:
                shared.track(params.n)

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def sampled(self) -> bool:
        """Drawn from a distribution (temperature > 0), not greedy."""
        return self.sampling is not None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    OWN_WEIGHT = 16.0  # proposals of a node after which the request's own rate counts as much as the replica's

    def node_rates(self) -> np.ndarray:
        """Each successor template node's acceptance: the request's own, pulled toward the replica's."""
        assert self.successors is not None
        k = self.OWN_WEIGHT
        return (self._node_accepted + k * self.successors.rates(self.sampled)) / (self._node_proposed + k)

    def offer(self, row_price: float = 0.0) -> Offer:
        """Gather this step's candidates into the tree and offer the planner each width this
        request can run. A whole step leaves out the tree rows accepted less often than
        `row_price` (what one more row of the step costs, in one-token steps)."""
        if self.params is None:
            return Offer(1)
        lay, last = self.layout, self.tokens[-1]
        cands: list[tuple[int, ...]] = []
        sources: list[Source] = []
        for src, index in ((Source.LOOKUP, self.suffix), (Source.HISTORY, self.history)):
            if index is not None and (copied := index.propose(self.tokens, self.params.lookup)):
                cands.append(copied)  # one copied run: the request's own text first, else the replica's
                sources.append(src)
                break
        g = len(cands) + lay.g
        copied_run = bool(cands)
        cands.extend(self.pool.lookup(last)[: lay.g])
        sources += [Source.POOL] * (len(cands) - len(sources))
        if self.shared is not None and len(cands) < g:
            self.shared.fill(lay.n, last, cands, g)
            sources += [Source.SHARED] * (len(cands) - len(sources))
        tags = [-1] * len(cands)
        if self.successors is not None:
            # nodes accepted less often than a row costs would leave every step: not built at all
            keep = self.node_rates() >= row_price if row_price > 0 else None
            succ, nodes = self.successors.propose(last, self.params.successors, keep)
            cands += succ
            sources += [Source.SUCCESSORS] * len(succ)
            tags += nodes
        self.tree.build(cands, sources=sources, tags=tags)
        p = self._rank_rows()
        # a whole step keeps the rows accepted more often than a row costs
        self._full_rows = int(np.count_nonzero(p >= row_price))
        full = lay.cand_start + self._full_rows
        # a step without the window keeps the m likeliest rows, for any m: the bonus token plus their chances
        verify = [(m + 1, float(e)) for m, e in enumerate(1.0 + np.cumsum(p))]
        if self.pacer is None:  # runs whole at `full` while the SLO allows; the menu prices it otherwise
            yields = self._full_yields.start(self.sampled)[copied_run] if self._full_yields is not None else 2.0
            return Offer(full, step_menu(full, verify, yields), None, copied_run)
        return Offer(1, self.pacer.menu(full, verify, copied_run), self.pacer, copied_run)

    def row_odds(self) -> np.ndarray:
        """Each tree row's chance of being accepted: its template node's rate for a successor
        row, else its source's at its depth; never above its parent's."""
        tree = self.tree
        n = tree.size
        src, depth = tree.source[:n], np.minimum(tree.depth[:n], self.row_rates.max_depth) - 1
        p = self.row_rates.rates(self._own_rates, self.OWN_WEIGHT)[src, depth]
        if self.successors is not None:
            succ = src == Source.SUCCESSORS
            p[succ] = self.node_rates()[tree.tag[:n][succ]]
        parent = tree.parent
        for r in range(n):
            if parent[r] >= 0 and p[parent[r]] < p[r]:
                p[r] = p[parent[r]]
        return p

    def _rank_rows(self) -> np.ndarray:
        """Order the tree's rows likeliest first (`_order`); returns their chances in that order.
        A child never outranks its parent: it is no likelier, and after it on ties."""
        p = self.row_odds()
        self._order = np.argsort(-p, kind="stable")
        return p[self._order]

    def plan(self, ids: np.ndarray, choice: StepChoice) -> Row:
        """Write this step's tokens into `ids`: [last | window | candidates] for a FULL step,
        [last | candidates] for VERIFY, the last token alone for PLAIN."""
        lay, tree = self.layout, self.tree
        ids[0] = self.tokens[-1]
        if choice.kind is StepKind.PLAIN:
            tree.build(())
            return Row(choice, 1, 1, self._verify_offsets, lay.verify_template)
        rows = self._full_rows if choice.kind is StepKind.FULL else choice.rows
        if rows is not None and rows < tree.size:
            tree.keep(self._order[:rows])
        if choice.kind is StepKind.VERIFY:
            start, offsets, template = 1, self._verify_offsets, lay.verify_template
        else:
            ids[lay.window_start : lay.cand_start] = self.window.flat()
            start, offsets, template = lay.cand_start, self._full_offsets, lay.mask_template
        end = start + tree.size
        ids[start:end] = tree.tokens[: tree.size]
        offsets[start:end] = tree.depth[: tree.size]
        return Row(choice, end, start, offsets, template)

    def _observe_nodes(self, tree: CandidateTree, accepted_rows: Seq[int]) -> None:
        assert self.successors is not None
        ran = tree.source[: tree.size] == Source.SUCCESSORS
        proposed = tree.tag[: tree.size][ran]
        accepted = [int(tree.tag[r]) for r in accepted_rows if tree.source[r] == Source.SUCCESSORS]
        self.successors.observe(proposed, accepted, self.sampled)
        np.add.at(self._node_proposed, proposed, 1.0)
        np.add.at(self._node_accepted, np.asarray(accepted, dtype=np.int64), 1.0)

    def accept(self, pred: Seq[int], row: Row, drawn: Mapping[int, int] | None = None) -> tuple[list[int], list[int]]:
        """Verify against the step's outputs (`pred`: argmax per row; `drawn`: for a sampled
        request, the token drawn at each step row of its walk, from `verification.draw_walks`);
        returns (step rows of the accepted candidate tokens, the new tokens after stop rules)."""
        lay, tree, start, choice = self.layout, self.tree, row.cand_start, row.choice
        if drawn is not None:  # the walk follows the drawn tokens; it never reaches a row not drawn
            walk = [-1] * (start + tree.size)
            for at, token in drawn.items():
                walk[at] = token
            pred_for_walk: Seq[int] = walk
        else:
            pred_for_walk = pred
        tree_rows, accepted = tree.walk_greedy(pred_for_walk, start)
        assert accepted[-1] >= 0, "the sampled walk reached a row that was not drawn"
        rows = [start + r for r in tree_rows]
        accepted, self.finish_reason = self.stop.clip(accepted, len(self.tokens) - self.prompt_len)
        self.step_sources = None
        if choice.kind is not StepKind.PLAIN:
            kept = tree_rows[: len(accepted) - 1]
            self.step_sources = (tuple(np.bincount(tree.source[: tree.size], minlength=len(Source)).tolist()),
                                 tuple(np.bincount(tree.source[kept], minlength=len(Source)).tolist()))
            self.stats.record_sources(*self.step_sources)
            hit = self._hit[: tree.size]
            hit[:] = False
            hit[kept] = True
            for rates in (self.row_rates, self._own_rates):
                rates.observe(tree.source[: tree.size], tree.depth[: tree.size], hit)
            if self.successors is not None:
                self._observe_nodes(tree, kept)
        before = len(self.tokens)
        self.tokens.extend(accepted)
        if self.params is not None:
            if choice.kind is StepKind.FULL:
                for ngram in self.window.update(pred[lay.newest_level_start : lay.cand_start]):
                    self.pool.add(ngram[0], ngram[1:])
            if self.pacer is not None:
                self.pacer.update(choice, len(accepted))
            if self.params.pool_from_prompt:
                self.pool.add_sequence(self.tokens, start=before - self.params.n + 1)
            if self.suffix is not None:
                self.suffix.extend(self.tokens)
        self.stats.record(choice.kind, row.width, len(accepted))
        return rows[: len(accepted) - 1], accepted

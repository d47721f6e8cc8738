"""One request's drafting: candidates from five sources into one tree, ranked; its span of the step
written from the planner's choice; what a verdict teaches."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from lookahead_core.constraints.grammar import GrammarState
from lookahead_core.lookahead.history import SuffixIndex
from lookahead_core.lookahead.knowledge import ROW_DEPTHS, ReplicaKnowledge
from lookahead_core.lookahead.layout import StepLayout
from lookahead_core.lookahead.ngram_pool import NGramPool
from lookahead_core.lookahead.pacing import StepChoice, StepKind, StepPacer
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.row_rates import RowRates
from lookahead_core.lookahead.tree import CandidateTree, Source
from lookahead_core.lookahead.verify import Verdict
from lookahead_core.lookahead.window import LookaheadWindow

OWN_WEIGHT = 16.0  # proposals after which a request's own acceptance counts as much as the replica's
FORCED_RUN = 16  # at most this many tokens of a grammar's forced text are proposed at once


@dataclass(frozen=True)
class Draft:
    """One step's candidates for one request: the tree (the drafter's buffer, valid until its next
    draft), its rows likeliest first with their chances, whether a copied run is among them, where
    a whole step's tree starts, and the tokens a whole step is expected to yield. `pacer` is None
    for a fixed (N, W, G), which runs whole while the SLO allows. `number`: which of its drafter's
    drafts it is; the drafter writes and learns from its latest only."""

    tree: CandidateTree
    order: np.ndarray
    odds: np.ndarray
    copied: bool
    full_start: int
    full_tokens: float
    pacer: StepPacer | None
    number: int = 0


@dataclass(frozen=True)
class Span:
    """One request's span of a step (its step rows): its width, where the tree starts, positions,
    mask template and tokens (`ids[1:width]`, the drafter's buffer, valid until its next write;
    row 0 is the last token, None: the last token alone)."""

    choice: StepChoice
    width: int
    cand_start: int
    offsets: np.ndarray
    template: torch.Tensor
    ids: np.ndarray | None = None


_PLAIN_OFFSETS = np.zeros(1, dtype=np.int64)
_PLAIN_OFFSETS.flags.writeable = False


_PLAIN = StepChoice(StepKind.PLAIN)


def plain_span(layout: StepLayout, choice: StepChoice = _PLAIN) -> Span:
    """The span of a one-token step: the last token alone."""
    return Span(choice, 1, 1, _PLAIN_OFFSETS, layout.verify_template)


class Drafter:
    """The drafting state of one request with lookahead: its Jacobi window, n-gram pool, suffix
    index, pacer and own acceptance counts, and the replica's tables it reads (`knowledge`).

    Verification candidates come, in order of priority, from prompt lookup over the request's own
    text (or, if it has no match, over the replica's history of finished requests), its n-gram pool
    (Jacobi window and text), the replica's shared pool for the slots left and a tree expanded from
    the last token through the replica's successor table, merged into one prefix tree.
    """

    def __init__(self, params: LookaheadParams, layout: StepLayout, tokens: list[int], sampled: bool,
                 knowledge: ReplicaKnowledge | None = None) -> None:
        self.params, self.layout, self.sampled = params, layout, sampled
        know = knowledge
        self.shared = know.shared_pool if know is not None else None
        self.history = know.history if know is not None and params.lookup else None
        self.successors = know.successors if know is not None and params.successors else None
        self._full_yields = know.full_yields if know is not None else None
        self.pacer: StepPacer | None = None
        if params.adapt:
            fy = self._full_yields
            self.pacer = StepPacer() if fy is None else StepPacer(fy.start(sampled), on_full=partial(fy.observe, sampled))
        # how often rows like the tree's were accepted: the replica's (greedy or sampled, as this
        # request is), and this request's own
        self.row_rates = know.row_rates[sampled] if know is not None else RowRates(ROW_DEPTHS)
        self._own_rates = RowRates(self.row_rates.max_depth, prior=False)
        if self.successors is not None:  # this request's own acceptance of each successor template node
            self._node_proposed = np.zeros(self.successors.max_nodes)
            self._node_accepted = np.zeros(self.successors.max_nodes)
        # step positions: the layout's for the last token and window, tree depths after them; or,
        # on a step without the window, tree depths right after the last token (buffers reused)
        self._full_offsets = layout.offsets.copy()
        self._ids = np.zeros(layout.max_tokens, dtype=np.int64)
        self.drafts = 0  # drafts made: only the latest's tree is in `tree`
        self._verify_offsets = np.zeros(1 + layout.max_tree_rows, dtype=np.int64)
        self.tree = CandidateTree(layout.max_tree_rows)
        self._hit = np.zeros(layout.max_tree_rows, dtype=bool)
        self.window = LookaheadWindow(params.n, params.w, tokens)
        self.pool = NGramPool(params.n, params.g)
        if params.pool_from_prompt:
            self.pool.add_sequence(tokens)
        self.suffix = SuffixIndex(params.lookup_match) if params.lookup else None
        if self.suffix is not None:
            self.suffix.extend(tokens)
        if self.shared is not None:
            self.shared.track(params.n)

    def node_rates(self) -> np.ndarray:
        """Each successor template node's acceptance: the request's own, pulled toward the replica's."""
        assert self.successors is not None
        k = OWN_WEIGHT
        return (self._node_accepted + k * self.successors.rates(self.sampled)) / (self._node_proposed + k)

    def draft(self, tokens: list[int], row_price: float = 0.0, grammar: GrammarState | None = None) -> Draft:
        """This step's candidates after `tokens`; successor nodes accepted less often than
        `row_price` (the planner's price of one more row, in one-token steps) are not built. Under
        a `grammar` (its state after `tokens`), the text it forces comes first and every candidate
        is cut where the grammar refuses it."""
        lay, last, params = self.layout, tokens[-1], self.params
        cands: list[tuple[int, ...]] = []
        sources: list[Source] = []
        if grammar is not None and (forced := grammar.forced_run(FORCED_RUN)):
            cands.append(tuple(forced))
            sources.append(Source.GRAMMAR)
        for src, index in ((Source.LOOKUP, self.suffix), (Source.HISTORY, self.history)):
            if index is not None and (copied := index.propose(tokens, params.lookup)):
                cands.append(copied)  # one copied run: the request's own text first, else the replica's
                sources.append(src)
                break
        g = len(cands) + lay.g
        copied_run = Source.LOOKUP in sources or Source.HISTORY in sources
        cands.extend(self.pool.lookup(last)[: lay.g])
        sources += [Source.POOL] * (len(cands) - len(sources))
        if self.shared is not None and len(cands) < g:
            self.shared.fill(lay.n, last, cands, g)
            sources += [Source.SHARED] * (len(cands) - len(sources))
        tags = [-1] * len(cands)
        if self.successors is not None:
            keep = self.node_rates() >= row_price if row_price > 0 else None
            succ, nodes = self.successors.propose(last, params.successors, keep)
            cands += succ
            sources += [Source.SUCCESSORS] * len(succ)
            tags += nodes
        if grammar is not None:
            cands = [cand[: grammar.valid_prefix(cand)] for cand in cands]
        self.tree.build(cands, sources=sources, tags=tags)
        p = self._row_odds()
        order = np.argsort(-p, kind="stable")  # a child never outranks its parent: no likelier, after it on ties
        if self.pacer is not None:
            full_tokens = self.pacer.yields[copied_run]
        else:
            full_tokens = self._full_yields.start(self.sampled)[copied_run] if self._full_yields is not None else 2.0
        self.drafts += 1
        return Draft(self.tree, order, p[order], copied_run, lay.cand_start, full_tokens, self.pacer, self.drafts)

    def _row_odds(self) -> np.ndarray:
        """Each tree row's chance of being accepted: its template node's rate for a successor
        row, else its source's at its depth; never above its parent's."""
        tree = self.tree
        n = tree.size
        src, depth = tree.source[:n], np.minimum(tree.depth[:n], self.row_rates.max_depth) - 1
        p = self.row_rates.rates(self._own_rates, OWN_WEIGHT)[src, depth]
        if self.successors is not None:
            succ = src == Source.SUCCESSORS
            p[succ] = self.node_rates()[tree.tag[:n][succ]]
        parent = tree.parent
        for r in range(n):
            if parent[r] >= 0 and p[parent[r]] < p[r]:
                p[r] = p[parent[r]]
        return p

    def write(self, draft: Draft, choice: StepChoice, last: int) -> Span:
        """The step's span, its tokens laid out in this drafter's buffer: [last | window | tree rows]
        for FULL, [last | tree rows] for VERIFY, the last token alone for PLAIN; the tree keeps the
        choice's likeliest rows."""
        if draft.number != self.drafts:
            raise ValueError(f"draft {draft.number} is stale: its tree was overwritten by draft {self.drafts}")
        lay, tree, ids = self.layout, draft.tree, self._ids
        ids[0] = last
        if choice.kind is StepKind.PLAIN:
            tree.build(())
            return plain_span(lay, choice)
        if choice.rows is not None and choice.rows < tree.size:
            tree.keep(draft.order[: choice.rows])
        if choice.kind is StepKind.VERIFY:
            start, offsets, template = 1, self._verify_offsets, lay.verify_template
        else:
            ids[lay.window_start : lay.cand_start] = self.window.flat()
            start, offsets, template = lay.cand_start, self._full_offsets, lay.mask_template
        end = start + tree.size
        ids[start:end] = tree.tokens[: tree.size]
        offsets[start:end] = tree.depth[: tree.size]
        return Span(choice, end, start, offsets, template, ids)

    def learn(self, span: Span, verdict: Verdict, pred: list[int], tokens: list[int]) -> None:
        """What a step taught: which tree rows were accepted (the replica's and this request's
        rates, successor nodes), the window's next level, the pacer's yield, the new text (`tokens`
        already holds the verdict's)."""
        choice, tree, lay = span.choice, self.tree, self.layout
        if choice.kind is not StepKind.PLAIN:
            kept = verdict.tree_rows
            hit = self._hit[: tree.size]
            hit[:] = False
            hit[kept] = True
            for rates in (self.row_rates, self._own_rates):
                rates.observe(tree.source[: tree.size], tree.depth[: tree.size], hit)
            if self.successors is not None:
                ran = tree.source[: tree.size] == Source.SUCCESSORS
                proposed = tree.tag[: tree.size][ran]
                accepted = [int(tree.tag[r]) for r in kept if tree.source[r] == Source.SUCCESSORS]
                self.successors.observe(proposed, accepted, self.sampled)
                np.add.at(self._node_proposed, proposed, 1.0)
                np.add.at(self._node_accepted, np.asarray(accepted, dtype=np.int64), 1.0)
        if choice.kind is StepKind.FULL:
            for ngram in self.window.update(pred[lay.newest_level_start : lay.cand_start]):
                self.pool.add(ngram[0], ngram[1:])
        if self.pacer is not None:
            self.pacer.update(choice, len(verdict.tokens))
        if self.params.pool_from_prompt:
            self.pool.add_sequence(tokens, start=len(tokens) - len(verdict.tokens) - self.params.n + 1)
        if self.suffix is not None:
            self.suffix.extend(tokens)

"""One request's decoding state: tokens, lookahead window and pool, stop rule and figures."""
from __future__ import annotations

import enum
from collections.abc import Callable
from collections.abc import Sequence as Seq

import numpy as np

from lookahead_core.engine.step_costs import StepCosts
from lookahead_core.lookahead.layout import StepLayout
from lookahead_core.lookahead.ngram_pool import NGramPool
from lookahead_core.lookahead.pacing import Menu, StepKind, StepPacer
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams, verify_sampling, warp
from lookahead_core.lookahead.shared_pool import SharedNGramPool
from lookahead_core.lookahead.stopping import StopCondition
from lookahead_core.lookahead.suffix_index import SuffixIndex
from lookahead_core.lookahead.tree import CandidateTree
from lookahead_core.lookahead.window import LookaheadWindow


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Plans the step rows of one request and takes the model's outputs for them.

    The last accepted token is never in the KV cache: each step feeds it first. Verification
    candidates come, in order of priority, from prompt lookup over the request's own text, its
    n-gram pool (Jacobi window and text) and the replica's `shared` pool for the slots left,
    merged into one prefix tree. A `StepPacer` narrows steps that do not pay. Changing the
    lookahead params rebuilds the window, pool and index from the tokens so far; exactness does
    not depend on them, only speed does.
    """

    def __init__(
        self,
        seq_id: str | int,
        prompt: Seq[int],
        params: LookaheadParams | None,
        stop: StopCondition,
        layout_for: Callable[[LookaheadParams | None], StepLayout],
        sampling: SamplingParams | None = None,
        shared: SharedNGramPool | None = None,
    ) -> None:
        if len(prompt) == 0:
            raise ValueError("the prompt must hold at least one token")
        self.seq_id = seq_id
        self.tokens: list[int] = [int(t) for t in prompt]
        self.prompt_len = len(self.tokens)
        self.stop = stop
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.steps = 0
        self.planned_tokens = 0  # step rows fed to the model, for the profile's mean step width
        self.accepted_histogram: dict[int, int] = {}
        self.logprobs: int | None = None  # alternatives to report per new token; None: no logprobs
        self.prompt_logprobs: int | None = None
        self.prompt_lp: list | None = None  # prompt logprobs gathered during prefill, until the first output
        self._layout_for = layout_for
        self.sampling = sampling if sampling is not None and not sampling.greedy else None
        # Seeded requests draw from their own stream, so they reproduce whatever else is batched.
        self.rng = np.random.default_rng(sampling.seed if sampling is not None else None)
        self.seeded = self.sampling is not None and sampling.seed is not None
        # Which candidates a sampled step verifies steers its random draws, so a seeded request
        # keeps to its own pool: its output then depends on its seed alone.
        self.shared = shared if self.sampling is None or self.sampling.seed is None else None
        self.params: LookaheadParams | None = None
        self._set_layout(None)
        self.set_params(params)

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def set_params(self, params: LookaheadParams | None) -> None:
        if params == self.params:
            return
        self.params = params
        self._set_layout(params)
        if params is not None:
            self.window = LookaheadWindow(params.n, params.w, self.tokens)
            self.pool = NGramPool(params.n, params.g)
            if params.pool_from_prompt:
                self.pool.add_sequence(self.tokens)
            self.suffix = SuffixIndex(params.lookup_match) if params.lookup else None
            if self.suffix is not None:
                self.suffix.extend(self.tokens)
            if self.shared is not None:
                self.shared.track(params.n)

    def _set_layout(self, params: LookaheadParams | None) -> None:
        self.layout = lay = self._layout_for(params)
        # Step positions: the layout's for the last token and window, tree depths after them;
        # or, on a step without the window, tree depths right after the last token.
        self._full_offsets = lay.offsets.copy()
        self._verify_offsets = np.zeros(1 + lay.max_tree_rows, dtype=np.int64)
        self.offsets, self.template, self.cand_start = self._full_offsets, lay.mask_template, lay.cand_start
        self.tree = CandidateTree(lay.max_tree_rows)
        self.pacer = StepPacer() if params is not None and params.adapt else None
        self.kind, self.copied = StepKind.PLAIN, False
        self._costs, self._batch, self._menu, self._paced = None, 1, False, False

    def _ratio(self, width: int) -> float:
        """A step of `width` against a one-token step: measured, or for a seeded request the prior."""
        costs = self._costs
        return costs.prior_ratio(width) if self.seeded else costs.ratio(self._batch, width)

    def propose(self, costs: StepCosts | None = None, batch: int = 1) -> tuple[Menu | None, int]:
        """Gather this step's candidates. Returns (menu, 1): the widths this request offers the
        batch (`batch_width` settles them), or (None, width): the width it takes regardless:
        plain, `adapt` off, alone in the batch, or seeded (which paces on a fixed prior, not on
        timings or other requests, so its output depends on its seed alone)."""
        self._costs, self._batch, self._menu, self._paced = costs, batch, False, False
        if self.params is None:
            self.kind = StepKind.PLAIN
            return None, 1
        lay = self.layout
        last = self.tokens[-1]
        cands = []
        if self.suffix is not None and (copied := self.suffix.propose(self.tokens, self.params.lookup)):
            cands.append(copied)
        self.copied = bool(cands)
        g = len(cands) + lay.g
        cands.extend(self.pool.lookup(last)[: lay.g])
        if self.shared is not None and len(cands) < g:
            self.shared.fill(lay.n, last, cands, g)
        rows = self.tree.build(cands)
        widths = {StepKind.FULL: lay.cand_start + rows}
        if rows:
            widths[StepKind.VERIFY] = 1 + rows
        self.kind = StepKind.FULL
        if self.pacer is None or costs is None:
            return None, widths[StepKind.FULL]
        if not self.seeded and costs.measured(batch, 1) is None:
            # every price is relative to a one-token step: measure that first, at this batch size
            self.kind = StepKind.PLAIN
            return None, 1
        self._paced = True
        if self.seeded or batch == 1:
            self.kind = self.pacer.choose(widths, self.copied, self._ratio)
            return None, 1 if self.kind is StepKind.PLAIN else widths[self.kind]
        self._menu = True
        return self.pacer.menu(widths, self.copied), 1

    def plan(self, ids: np.ndarray, cap: int | None = None) -> int:
        """Write this step's tokens [last | window | candidates] (or fewer, as paced) into `ids`,
        no wider than `cap` if this request offered a menu; return how many."""
        lay, tree = self.layout, self.tree
        ids[0] = self.tokens[-1]
        if self.params is None:
            self.planned_tokens += 1
            return 1
        if self._menu:
            self.kind = self.pacer.pick(cap, self._ratio)
        kind = self.kind
        if kind is not StepKind.FULL:
            if kind is StepKind.PLAIN:
                tree.build(())
            self.cand_start, self.template, self.offsets = 1, lay.verify_template, self._verify_offsets
        else:
            ids[lay.window_start : lay.cand_start] = self.window.flat()
            self.cand_start, self.template, self.offsets = lay.cand_start, lay.mask_template, self._full_offsets
        start = self.cand_start
        n_tok = start + tree.size
        ids[start:n_tok] = tree.tokens[: tree.size]
        self.offsets[start:n_tok] = tree.depth[: tree.size]
        self.planned_tokens += n_tok
        return n_tok

    def accept(self, pred: Seq[int], logits=None) -> tuple[list[int], list[int]]:
        """Verify against the step's outputs (argmax per row; the logits rows [T, V] when
        sampling); returns (step rows of the accepted candidate tokens, the new tokens after stop
        rules)."""
        lay, tree, start = self.layout, self.tree, self.cand_start
        if self.sampling is None:
            rows, accepted = tree.walk_greedy(pred, start)
            rows = [start + r for r in rows]
        else:
            dists = logits.float().cpu().numpy() if hasattr(logits, "numpy") else logits
            params = self.sampling
            paths = [[start + r for r in path] for path in tree.paths]
            chosen, accepted = verify_sampling(lambda r: warp(dists[r], params), tree.candidates, paths, self.rng)
            rows = paths[chosen] if chosen >= 0 else []
        accepted, self.finish_reason = self.stop.clip(accepted, len(self.tokens) - self.prompt_len)
        before = len(self.tokens)
        self.tokens.extend(accepted)
        if self.params is not None:
            pool = self.pool
            if self.kind is StepKind.FULL:
                for ngram in self.window.update(pred[lay.newest_level_start : lay.cand_start]):
                    pool.add(ngram[0], ngram[1:])
            if self._paced:
                self.pacer.update(len(accepted))
            if self.params.pool_from_prompt:
                pool.add_sequence(self.tokens, start=before - self.params.n + 1)
            if self.suffix is not None:
                self.suffix.extend(self.tokens)
        self.steps += 1
        self.accepted_histogram[len(accepted)] = self.accepted_histogram.get(len(accepted), 0) + 1
        if self.finished:
            self.status = Status.FINISHED
        return rows[: len(accepted) - 1], accepted

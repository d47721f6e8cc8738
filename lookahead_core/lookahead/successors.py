"""Candidates from the model's own top-k: each token's likeliest successors, recycled from earlier steps."""
from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

# How often a successor of each rank, proposed right after the last token, was accepted (6 chat and
# 6 code prompts, SmolLM2-135M, float32, a 32-node tree, every step whole): the prior of the
# tree template, which spends its rows on the rank paths with the highest product of rates.
RANK_HIT_RATE = (0.32, 0.055, 0.048, 0.02, 0.037, 0.016, 0.028, 0.012)


def tree_template(rows: int, k: int, rates: Sequence[float] = RANK_HIT_RATE) -> list[tuple[int, int]]:
    """The `rows` rank paths with the highest product of rank hit rates, parents first, as
    (parent node or -1 for the last token, rank) per node."""
    rates = list(rates[:k]) + [rates[-1]] * max(0, k - len(rates))
    nodes: list[tuple[int, int]] = []
    heap = [(-rates[r], r, -1) for r in range(k)]  # (-probability, rank, parent)
    heapq.heapify(heap)
    while heap and len(nodes) < rows:
        neg_p, rank, parent = heapq.heappop(heap)
        nodes.append((parent, rank))
        me = len(nodes) - 1
        for r in range(k):
            heapq.heappush(heap, (neg_p * rates[r], r, me))
    return nodes


class SuccessorTable:
    """vocab x k: the k likeliest next tokens the model gave after each token, the last time a
    step computed a row whose input was that token (Token Recycling, Luo et al. 2024).

    Every row of a step (last token, window, candidate tree, and the prompt at prefill) yields
    logits; their top-k are kept instead of thrown away, so a token seen once in any context
    proposes its successors from then on. A candidate tree is expanded from the last token
    through the table along a fixed template of `max_nodes` rank paths; how often each template
    node is accepted is counted here, replica-wide and apart for greedy and sampled requests (a
    sampled one accepts a node only where its draw lands on it), so a request can leave out nodes
    that do not earn their row. Memory: `vocab * k * 4` bytes and four floats per node, allocated once.
    Shared by a replica's requests: what one request's steps computed speeds up another's,
    never changes its tokens.
    """

    PSEUDO = 8.0  # the template's prior rates count as this many proposals of each node

    def __init__(self, vocab: int, k: int, max_nodes: int = 32) -> None:
        if vocab < 1 or k < 1 or max_nodes < 1:
            raise ValueError(f"successor table needs vocab, k and max_nodes >= 1, got {vocab}, {k}, {max_nodes}")
        self.k = k
        self.table = np.full((vocab, k), -1, dtype=np.int32)
        self.template = tree_template(max_nodes, k)
        self.prior = np.array(_node_rates(self.template, k))
        # [greedy, sampled] x node
        self.proposed = np.full((2, len(self.template)), self.PSEUDO)
        self.accepted = np.tile(self.prior * self.PSEUDO, (2, 1))

    @property
    def max_nodes(self) -> int:
        return len(self.template)

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + self.proposed.nbytes + self.accepted.nbytes

    @property
    def known(self) -> int:
        """Tokens with successors recorded."""
        return int((self.table[:, 0] >= 0).sum())

    def rates(self, sampled: bool = False) -> np.ndarray:
        """Per template node, the share of its proposals that were accepted (prior included), by
        greedy or sampled requests."""
        return self.accepted[int(sampled)] / self.proposed[int(sampled)]

    def update(self, tokens: np.ndarray, topk: np.ndarray) -> None:
        """Record `topk[i]` (likeliest first) as the successors of `tokens[i]`; a later row wins."""
        self.table[tokens] = topk[:, : self.k]

    def observe(self, proposed: Sequence[int], accepted: Sequence[int], sampled: bool = False) -> None:
        """Template nodes a step ran as tree rows, and those of them it accepted."""
        np.add.at(self.proposed[int(sampled)], np.asarray(proposed, dtype=np.int64), 1.0)
        np.add.at(self.accepted[int(sampled)], np.asarray(accepted, dtype=np.int64), 1.0)

    def propose(self, last: int, nodes: int, keep: np.ndarray | None = None) -> tuple[list[tuple[int, ...]], list[int]]:
        """Candidate paths from `last` through the table along the first `nodes` template nodes
        (parents before children) and each one's node; a node is left out with its subtree when
        `keep[node]` is False or its parent has no successors recorded."""
        table = self.table
        paths: list[tuple[int, ...] | None] = []
        out: list[tuple[int, ...]] = []
        ids: list[int] = []
        for node, (parent, rank) in enumerate(self.template[:nodes]):
            prefix = () if parent < 0 else paths[parent]
            if prefix is None or (keep is not None and not keep[node]):
                paths.append(None)
                continue
            tok = int(table[prefix[-1] if prefix else last, rank])
            if tok < 0:
                paths.append(None)
                continue
            path = (*prefix, tok)
            paths.append(path)
            out.append(path)
            ids.append(node)
        return out, ids

    def clear(self) -> None:
        self.table.fill(-1)
        self.proposed.fill(self.PSEUDO)
        self.accepted[:] = self.prior * self.PSEUDO  # both rows


def _node_rates(template: list[tuple[int, int]], k: int) -> list[float]:
    rates = list(RANK_HIT_RATE[:k]) + [RANK_HIT_RATE[-1]] * max(0, k - len(RANK_HIT_RATE))
    out: list[float] = []
    for parent, rank in template:
        out.append(rates[rank] * (out[parent] if parent >= 0 else 1.0))
    return out

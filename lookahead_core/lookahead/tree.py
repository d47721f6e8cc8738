"""Verification candidates merged into a prefix tree: one step row per distinct prefix."""
from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np


class Source(enum.IntEnum):
    """Where a candidate came from; a tree row belongs to the first candidate that needed it."""

    LOOKUP = 0  # the request's own text after an earlier occurrence of its suffix (prompt lookup)
    POOL = 1  # the request's n-gram pool: Jacobi window trajectories and its own text
    SHARED = 2  # the replica's n-grams of finished requests
    SUCCESSORS = 3  # the replica's table of the model's top-k after each token
    HISTORY = 4  # finished requests' text after the longest match of the request's suffix
    GRAMMAR = 5  # the text the request's grammar forces next


SOURCE_NAMES = tuple(s.name.lower() for s in Source)  # as reported, in `Source` order


class CandidateTree:
    """Candidates from every source share the rows of their common prefixes.

    Row i of the tree holds `tokens[i]` at `depth[i]` (1 = right after the last token) and sees
    the tree rows `visible[i]`: its ancestors and itself. Parents come before children, so each
    candidate's rows increase. Arrays are sized once for `max_rows`; `build` refills them.
    """

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.tokens = np.zeros(max_rows, dtype=np.int64)
        self.depth = np.zeros(max_rows, dtype=np.int64)
        self.source = np.zeros(max_rows, dtype=np.int64)
        self.tag = np.zeros(max_rows, dtype=np.int64)  # the source's own label of the row (a template node)
        self.parent = np.zeros(max_rows, dtype=np.int64)  # the parent row, -1 under the last token
        self.visible = np.zeros((max_rows, max_rows), dtype=bool)
        self.size = 0
        self.candidates: list[tuple[int, ...]] = []  # as kept: deduplicated, cut to the budget
        self.paths: list[list[int]] = []  # the rows of each kept candidate
        self._labels: list[tuple[Source, int]] = []  # each kept candidate's source and tag
        self._children: list[dict[int, int]] = [{}]  # node 0 is the root (the last token); row = node - 1

    def build(self, candidates: Sequence[Sequence[int]], budget: int | None = None,
              sources: Sequence[Source] | None = None, tags: Sequence[int] | None = None) -> int:
        """Insert candidates in order of priority until `budget` rows are used; return the rows.
        `sources[i]` is where candidate i came from and `tags[i]` the source's label for its last
        token, recorded per row it adds."""
        budget = self.max_rows if budget is None else min(budget, self.max_rows)
        self.visible[: self.size, : self.size] = False
        self.size = 0
        self.candidates, self.paths, self._labels = [], [], []
        children = self._children = [{}]
        seen: set[tuple[int, ...]] = set()
        for i, cand in enumerate(candidates):
            src = Source.POOL if sources is None else sources[i]
            node = 0
            path: list[int] = []
            for tok in cand:
                child = children[node].get(tok)
                if child is None:
                    if self.size >= budget:
                        break
                    row = self.size
                    child = row + 1
                    self.size += 1
                    children[node][tok] = child
                    children.append({})
                    self.tokens[row] = tok
                    self.depth[row] = len(path) + 1
                    self.source[row] = src
                    self.tag[row] = -1 if tags is None else tags[i]
                    self.parent[row] = node - 1
                    if node:
                        self.visible[row, : row] = self.visible[node - 1, : row]
                    self.visible[row, row] = True
                node = child
                path.append(child - 1)
            kept = tuple(cand[: len(path)])
            if path and kept not in seen:
                seen.add(kept)
                self.candidates.append(kept)
                self.paths.append(path)
                self._labels.append((src, -1 if tags is None else tags[i]))
        return self.size

    def keep(self, rows: Sequence[int] | np.ndarray) -> int:
        """Rebuild with only these rows, which must hold every kept row's parent; return the size."""
        kept = np.zeros(self.size, dtype=bool)
        kept[np.asarray(rows, dtype=np.int64)] = True
        cands, sources, tags = [], [], []
        for cand, path, (src, tag) in zip(self.candidates, self.paths, self._labels):
            n = 0
            while n < len(path) and kept[path[n]]:
                n += 1
            if n:
                cands.append(cand[:n])
                sources.append(src)
                tags.append(tag)
        return self.build(cands, sources=sources, tags=tags)

    def child(self, node: int, token: int) -> int | None:
        """The child of `node` (0: the last token; tree row r is node r + 1) holding `token`, as a node."""
        return self._children[node].get(token)

    def walk_greedy(self, predictions: Sequence[int], row0: int) -> tuple[list[int], list[int]]:
        """Follow the model's argmax down the tree: (tree rows accepted, accepted tokens + bonus).

        `predictions[r]` is the argmax after step row r; step row 0 is the last token and tree row
        i sits at step row `row0 + i`.
        """
        rows: list[int] = []
        expected = predictions[0]
        node = 0
        children = self._children
        while (child := children[node].get(expected)) is not None:
            rows.append(child - 1)
            node = child
            expected = predictions[row0 + child - 1]
        return rows, [*(int(self.tokens[r]) for r in rows), expected]

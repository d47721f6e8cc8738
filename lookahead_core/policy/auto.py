"""Applies the policy's (N, W, G) to the requests that asked for lookahead "auto"."""
from __future__ import annotations

import threading

from lookahead_core.engine.engine import Engine
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.policy.controller import LookaheadPolicy


class AutoLookahead:
    """Runs on the engine thread before each step: one router decision per step, from the
    replica's queue depth, pushed to every running "auto" request. What those requests got since
    the last step (steps, tokens, rows) is fed back to the router first."""

    def __init__(self, router: LookaheadPolicy) -> None:
        self.router = router
        self.auto_ids: set[str | int] = set()
        self.current: LookaheadParams | None = router.choose(1)
        self.choices: dict[str, int] = {}
        self._progress: dict[str | int, tuple[int, int, int]] = {}  # running auto requests' counters at the last look
        self._lock = threading.Lock()  # choices grow on the engine thread and are read from the event loop

    def register(self, seq_id: str | int) -> LookaheadParams | None:
        self.auto_ids.add(seq_id)
        return self.current

    def forget(self, seq_id: str | int) -> None:
        self.auto_ids.discard(seq_id)
        self._progress.pop(seq_id, None)

    def choice_counts(self) -> dict[str, int]:
        """Steps per chosen setting so far, safe to call from any thread."""
        with self._lock:
            return dict(self.choices)

    def before_step(self, engine: Engine) -> None:
        progress = engine.running_progress()
        self._feed_back(progress)
        running, waiting = engine.queue_depth()
        self.current = self.router.choose(running + waiting)
        label = "plain" if self.current is None else f"{self.current.n},{self.current.w},{self.current.g}"
        with self._lock:
            self.choices[label] = self.choices.get(label, 0) + 1
        for seq_id in progress:
            if seq_id in self.auto_ids:
                engine.set_params(seq_id, self.current)

    def _feed_back(self, progress: dict) -> None:
        by_params: dict[LookaheadParams | None, list[int]] = {}
        for seq_id, (params, steps, tokens, rows) in progress.items():
            if seq_id not in self.auto_ids:
                continue
            last = self._progress.get(seq_id)
            self._progress[seq_id] = (steps, tokens, rows)
            if last is None or steps <= last[0]:
                continue
            total = by_params.setdefault(params, [0, 0, 0])
            for i, (now, before) in enumerate(zip((steps, tokens, rows), last)):
                total[i] += now - before
        for params, (steps, tokens, rows) in by_params.items():
            self.router.observe(params, steps, tokens, rows)
        for seq_id in [s for s in self._progress if s not in progress]:
            del self._progress[seq_id]

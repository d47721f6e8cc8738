"""Applies the router's (N, W, G) to the requests that asked for lookahead "auto"."""
from __future__ import annotations

from .engine import Engine
from .params import LookaheadParams
from .router import Router


class AutoLookahead:
    """Runs on the engine thread before each step: one router decision per step, from the
    replica's queue depth, pushed to every running "auto" request."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.auto_ids: set[str | int] = set()
        self.current: LookaheadParams | None = router.choose(1)
        self.choices: dict[str, int] = {}

    def register(self, seq_id: str | int) -> LookaheadParams | None:
        self.auto_ids.add(seq_id)
        return self.current

    def forget(self, seq_id: str | int) -> None:
        self.auto_ids.discard(seq_id)

    def before_step(self, engine: Engine) -> None:
        running, waiting = engine.queue_depth()
        self.current = self.router.choose(running + waiting)
        label = "plain" if self.current is None else f"{self.current.n},{self.current.w},{self.current.g}"
        self.choices[label] = self.choices.get(label, 0) + 1
        for seq_id in engine.running_params():
            if seq_id in self.auto_ids:
                engine.set_params(seq_id, self.current)

"""When a graph that raised is checked again: after each pause of a schedule, then never."""
from __future__ import annotations

from collections.abc import Hashable

# A transient failure (memory pressure) passes: the graph runs again once it passes its check.
RETRY_AFTER_S = (10.0, 60.0, 600.0)


class Retries:
    """The drops of each graph and when each dropped graph is due for its check."""

    def __init__(self, pauses: tuple[float, ...] = RETRY_AFTER_S) -> None:
        self.pauses = pauses
        self.drops: dict[Hashable, int] = {}
        self._due: dict[Hashable, float] = {}

    def dropped(self, key: Hashable, now: float) -> float | None:
        """Count a drop; the pause until its check, or None where the schedule is spent."""
        n = self.drops[key] = self.drops.get(key, 0) + 1
        if n > len(self.pauses):
            return None
        self._due[key] = now + self.pauses[n - 1]
        return self.pauses[n - 1]

    def due(self, now: float) -> list:
        """The dropped graphs whose pause has passed (each returned once per drop)."""
        keys = [key for key, at in self._due.items() if at <= now]
        for key in keys:
            del self._due[key]
        return keys

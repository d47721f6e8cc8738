"""Incremental detokenization with stop strings."""
from __future__ import annotations


class TextStream:
    """Turns accepted token ids into text deltas.

    Text that could still be the start of a stop string, or an incomplete UTF-8 character, is
    held back until it is settled; `flush` releases it at the end. A stop string ends the text
    before it (it is not included), as in the OpenAI API.
    """

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # emitted so far
        self.stopped = False

    def _decoded(self) -> str:
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return full.rstrip("\ufffd")

    def push(self, ids: list[int]) -> tuple[str, bool]:
        """Add tokens; returns (new text, whether a stop string was hit)."""
        self.ids.extend(ids)
        full = self._decoded()
        start = max(0, len(self.text) - self.hold)
        hits = [i for i in (full.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            delta = full[len(self.text) : end] if end > len(self.text) else ""
            self.text = full[:end] if end > len(self.text) else self.text
            self.stopped = True
            return delta, True
        safe = max(len(self.text), len(full) - self.hold)
        delta = full[len(self.text) : safe]
        self.text += delta
        return delta, False

    def flush(self) -> str:
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        delta = full[len(self.text) :]
        self.text = full
        return delta

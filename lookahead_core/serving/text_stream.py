"""Incremental detokenization with stop strings, at a cost per step that does not grow with the text."""
from __future__ import annotations

from collections.abc import Iterable


class TextStream:
    """Turns accepted token ids into text deltas.

    Each push decodes only a small window: the tokens since the last settled one plus a little
    context (the prefix/read-offset method of vLLM and TGI), not the whole output. A token that
    ends in an incomplete UTF-8 character (decoded as U+FFFD) settles once a later token completes
    it. Text that could still be the start of a stop string is held back too; `flush` releases
    what is held at the end. A stop string ends the text before it (it is not included), as in the
    OpenAI API. Without stop strings the deltas concatenate to `tokenizer.decode(ids,
    skip_special_tokens=True)`. As in vLLM: the `stop_ids` (the stop token that ended the output)
    have no text, and a stop string counts only where it ends in the text after the first
    `min_tokens` tokens.
    """

    def __init__(self, tokenizer, stops: list[str] | tuple[str, ...] = (), stop_ids: Iterable[int] = (),
                 min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.skip = frozenset(stop_ids)
        self.min_tokens = min_tokens
        self.floor = 0  # characters of text before min_tokens tokens: no stop string ends within them
        self.emitted = 0  # characters emitted
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # tokens before this are settled text
        self.pending = ""  # settled text held back: it may begin a stop string
        self.chunks: list[str] = []  # emitted text
        self.stopped = False
        self.kept = 0  # after a stop: how many tokens of the last push the text runs to (the stop's last token)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self.chunks)

    def _decode(self, ids: list[int]) -> str:
        if self.skip:
            ids = [t for t in ids if t not in self.skip]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _find(self, text: str, stop: str, start: int) -> int:
        """Where `stop` first occurs in `text` (which begins at character `start` of the output)
        ending past the floor; -1 if nowhere."""
        return text.find(stop, max(0, self.floor - start - len(stop) + 1))

    def _settle(self, final: bool = False) -> str:
        """Text of the tokens since read_offset, once it ends in a whole character ('' until then)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        # The tokens just settled become the next window's context, so that joins between tokens
        # (spaces, clean-up) come out as in one decode of everything.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def _emit(self, text: str) -> str:
        if text:
            self.chunks.append(text)
            self.emitted += len(text)
        return text

    def push(self, ids: list[int] | tuple[int, ...]) -> tuple[str, bool]:
        """Add tokens; returns (new text, whether a stop string was hit; `kept` then says how many
        of these tokens up to it). After a hit, nothing more."""
        if self.stopped:
            return "", True
        before = self.min_tokens - len(self.ids)
        if 0 < before < len(ids):  # the floor falls inside this step: its tokens up to it settle first
            head, _ = self.push(ids[:before])
            tail, hit = self.push(ids[before:])
            self.kept += before if hit else 0
            return head + tail, hit
        base = len(self.ids)
        self.ids.extend(ids)
        buf = self.pending + self._settle()
        if len(self.ids) <= self.min_tokens:
            self.floor, hits = self.emitted + len(buf), []
        else:
            hits = [i for i in (self._find(buf, s, self.emitted) for s in self.stops) if i >= 0]
        if hits:
            self.pending, self.stopped = "", True
            self.kept = self._tokens_to_stop(base)
            return self._emit(buf[: min(hits)]), True
        cut = max(0, len(buf) - self.hold)
        self.pending = buf[cut:]
        return self._emit(buf[:cut]), False

    def _tokens_to_stop(self, base: int) -> int:
        """The fewest of the tokens pushed after `base` whose text completes a stop string: a step
        that accepted more reports only these, as one-token steps would."""
        for k in range(1, len(self.ids) - base):
            text = self._decode(self.ids[: base + k])
            if any(self._find(text, s, 0) >= 0 for s in self.stops):
                return k
        return len(self.ids) - base

    def flush(self) -> str:
        """The text held back at the end of the request (an incomplete character comes out as U+FFFD)."""
        if self.stopped:
            return ""
        tail, self.pending = self.pending + self._settle(final=True), ""
        return self._emit(tail)

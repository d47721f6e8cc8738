"""The calls a model made, read from its output whole or as it streams, in the one format `tools` asks for: under "auto"
<tool_call>{"name", "arguments"}</tool_call> blocks among the text, under "required" a JSON array of calls, under a
named function one call. Never raises on the model's text."""
from __future__ import annotations

import json
from collections.abc import Sequence

from lookahead_core.serving.outputs import ToolCall
from lookahead_core.serving.tools import CALL_CLOSE, CALL_OPEN, ToolChoice, ToolSpec, loads_or_text

StreamEvent = str | ToolCall  # content text, or a call


class ToolCallStream:
    """One choice's text deltas into content and calls, as `parse_tool_calls` reads the whole text. Unforced, content
    passes through less what may begin a <tool_call> tag and its trailing whitespace (each held until it cannot or
    more content comes; whitespace dropped at the end where calls were made), and a block is a call when it closes,
    content where it holds no call of a known tool. Forced, the calls come at `finish`, all of them or none."""

    def __init__(self, choice: ToolChoice, tools: Sequence[ToolSpec]) -> None:
        self.choice = choice
        self.names = tuple(t.name for t in choice.offered(tools))  # not hashed: a model's "name" may be a list
        self.calls: list[ToolCall] = []
        self.buffer = ""  # the text not settled yet
        self.held = ""  # the content's trailing whitespace

    def feed(self, delta: str) -> list[StreamEvent]:
        seen, self.buffer = len(self.buffer), self.buffer + delta
        return [] if self.choice.forced else self._auto(seen)

    def finish(self) -> list[StreamEvent]:
        """The rest, at the end of the output: what did not parse, as content."""
        rest, self.buffer = self.buffer, ""
        if self.choice.forced:
            self.calls = self._forced(rest)
            return list(self.calls) or ([rest] if rest else [])
        events, held, self.held = self._content(rest), self.held, ""
        return events + [held] if held and not self.calls else events

    def _content(self, text: str) -> list[StreamEvent]:
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return [body] if body else []

    def _auto(self, seen: int) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        t, pos = self.buffer, 0
        # the `seen` text held no closing tag: an open block is searched in its new text only
        while (start := t.find(CALL_OPEN, pos)) >= 0 and (close := t.find(CALL_CLOSE, max(start, seen - len(CALL_CLOSE) + 1))) >= 0:
            end = close + len(CALL_CLOSE)
            call = self._call(t[start + len(CALL_OPEN):close], len(self.calls))
            events += self._content(t[pos:start] if call else t[pos:end])
            if call:
                self.calls.append(call)
                events.append(call)
            pos = end
        # settled: the text up to an open block, or short of what may begin a tag
        tag = next((k for k in range(len(CALL_OPEN) - 1, 0, -1) if t.endswith(CALL_OPEN[:k])), 0)
        stop = start if start >= 0 else max(pos, len(t) - tag)
        events += self._content(t[pos:stop])
        self.buffer = t[stop:]
        return events

    def _forced(self, text: str) -> list[ToolCall]:
        """A forced output's calls: all of them, or none where it does not parse (cut short)."""
        obj = loads_or_text(text)
        items = [obj] if self.choice.mode == "function" else obj if isinstance(obj, list) and obj else [None]
        calls = [self._call(o, i) if isinstance(o, dict) else None for i, o in enumerate(items)]
        return [c for c in calls if c] if all(calls) else []

    def _call(self, source: object, index: int) -> ToolCall | None:
        """A call of a known tool from its JSON (text or parsed), or None. "parameters" is taken for "arguments", as
        some models write it, and arguments written as JSON text are read."""
        obj = loads_or_text(source)
        args = loads_or_text(obj.get("arguments", obj.get("parameters", {}))) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or obj.get("name") not in self.names or not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":")), index)


def parse_tool_calls(text: str, choice: ToolChoice, tools: Sequence[ToolSpec]) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content and calls: the text unchanged where it made no call, else the text outside the calls
    (trailing whitespace dropped), None where none is left. Never raises on the model's text."""
    stream = ToolCallStream(choice, tools)
    content = "".join(e for e in stream.feed(text) + stream.finish() if isinstance(e, str))
    return ((content or None) if stream.calls else content), list(stream.calls)


def finish_reason(calls: Sequence[object], reason: str) -> str:
    """"tool_calls" where calls were made and the output ended itself ("stop", "eos"); a cut one keeps its reason."""
    return "tool_calls" if calls and reason in ("stop", "eos") else reason

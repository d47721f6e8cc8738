"""One choice of a served request as it streams: the engine's outputs in, text deltas and the
completion out, and what the engine raised as the client hears it."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from lookahead_core.engine.engine import EngineOverloaded
from lookahead_core.engine.host.async_engine import EngineStopped, RequestTimeout
from lookahead_core.engine.io import EngineRequest, SequenceStats, StepOutput, TokenLogprob
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.stopping import FinishReason
from lookahead_core.serving.outputs import Completion, Delta, Logprob, LookaheadSummary, RequestError, Timings, ToolCall, Usage
from lookahead_core.serving.request import ServeRequest
from lookahead_core.serving.text_stream import TextStream
from lookahead_core.serving.tool_calls import ToolCallStream

Failure = tuple[tuple[type[Exception], ...], int, Callable[[Exception], str], "str | None", "str | None"]
# What the engine raises, as the client hears it, the first match in order: (status, message, code, type).
ENGINE_ERRORS: tuple[Failure, ...] = (
    ((EngineOverloaded,), 503, lambda e: f"replica overloaded: {e}", "overloaded", None),
    # a server fault another replica need not share: retry
    ((EngineStopped,), 503, lambda e: f"the engine stopped ({e}); retry", "replica_failed", "server_error"),
    ((ValueError, TypeError), 400, str, None, None),
    # the engine step failed; the engine has already started clean
    ((RuntimeError,), 500, lambda e: f"generation failed: {e}", None, None),
)
# What a choice's stream may raise: the table's and its deadline.
FAILURES: tuple[type[Exception], ...] = (RequestTimeout, *(t for kinds, *_ in ENGINE_ERRORS for t in kinds))


class ChoiceRun:
    """Choice `index` of `req` (its engine request `ereq`, run with `params`, `timeout_s`): each
    output's tokens become text through its stop strings; `hit` once one matched. Where the request
    offers tools, the text becomes content and calls (`ToolCallStream`): the one reading of both the
    streamed and the whole answer."""

    def __init__(self, req: ServeRequest, ereq: EngineRequest, params: LookaheadParams | None, prompt: list[int],
                 index: int, timeout_s: float | None, text: TextStream, token_text: Callable[[int], str],
                 prompt_text: Callable[[], str]) -> None:
        self.req, self.ereq, self.params, self.prompt, self.index, self.timeout_s = req, ereq, params, prompt, index, timeout_s
        self.text, self.token_text, self.prompt_text = text, token_text, prompt_text
        self.t0 = time.perf_counter()
        self.tokens: list[int] = []
        self.logprobs: list[Logprob] | None = None if req.logprobs is None else []
        self.echoed = ""
        self.stats: SequenceStats | None = None  # the engine's count, on the request's last output
        self.reason: FinishReason | None = None
        self.ttft: float | None = None
        self.hit = False
        self._first = True
        self.tool_stream = ToolCallStream(req.tool_choice, req.tools) if req.tool_choice.mode != "none" else None
        self.content: list[str] = []  # with tools: the text outside the calls

    def _read(self, text: str, end: bool = False) -> tuple[str, tuple[ToolCall, ...]]:
        """A text delta as content and the calls it completed (`end`: the output's last)."""
        if self.tool_stream is None:
            return text, ()
        events = self.tool_stream.feed(text) + (self.tool_stream.finish() if end else [])
        content = "".join(e for e in events if isinstance(e, str))
        self.content.append(content)
        return content, tuple(e for e in events if isinstance(e, ToolCall))

    def _usage(self) -> Usage:
        return Usage(len(self.prompt), len(self.tokens))

    def _logprobs(self, items: Iterable[TokenLogprob | None] | None, token_ids: Iterable[int]) -> tuple[Logprob, ...]:
        assert items is not None, "the engine sends logprobs whenever the request asks for them"
        text = self.token_text
        return tuple(Logprob(text(t), t, None) if lp is None else
                     Logprob(text(t), t, lp.logprob, tuple((text(i), v) for i, v in lp.top))
                     for lp, t in zip(items, token_ids))

    def on_output(self, out: StepOutput) -> list[Delta]:
        """The deltas of one engine output: the echoed prompt before the first, then the step's
        text. A step may accept tokens past a stop string: they are cut, from the text and from the
        ids, usage and logprobs alike, as one-token steps would have it."""
        deltas = []
        if self.req.echo and self._first:
            self.echoed = self.prompt_text()
            lps = None if self.logprobs is None else self._logprobs(out.prompt_logprobs, self.prompt)
            self.logprobs = None if lps is None else [*lps]
            deltas.append(Delta((), self.echoed, self.index, lps, Usage(len(self.prompt), 0)))
        self._first = False
        if out.tokens:
            self.ttft = self.ttft if self.ttft is not None else time.perf_counter() - self.t0
            delta, self.hit = self.text.push(out.tokens)
            step_tokens = out.tokens[: self.text.kept] if self.hit else out.tokens
            self.tokens.extend(step_tokens)
            lps = None if self.logprobs is None else self._logprobs(out.logprobs, step_tokens)
            if self.logprobs is not None and lps is not None:
                self.logprobs.extend(lps)
            if self.hit:
                self.reason = FinishReason.STOP
            content, calls = self._read(delta)
            deltas.append(Delta(tuple(step_tokens), content, self.index, lps, self._usage(), calls))
        if out.finish_reason is not None and not self.hit:
            self.reason, self.stats = out.finish_reason, out.stats
        return deltas

    def fail(self, exc: Exception) -> None:
        """What the engine raised, as a RequestError; a deadline passed after the first token ends
        the choice instead (TIMEOUT)."""
        if isinstance(exc, RequestTimeout):
            if self.tokens:
                self.reason = FinishReason.TIMEOUT
                return
            assert self.timeout_s is not None, "only a request with a deadline times out"
            # The client's own deadline is a 408; the server's ceiling is a 504.
            own = self.req.timeout_s is not None and self.req.timeout_s <= self.timeout_s
            status, whose = (408, "its timeout_s") if own else (504, "the server's request_timeout_s")
            raise RequestError(status, f"request timed out after {self.timeout_s:g} s ({whose}) before its first "
                                       "token", code="timeout") from None
        for kind, status, message, code, error_type in ENGINE_ERRORS:
            if isinstance(exc, kind):
                raise RequestError(status, message(exc), code=code, type=error_type) from None
        raise exc

    def tail(self) -> list[Delta]:
        """Text held back to the end (a possible stop string's start, a call not yet closed), as a last delta."""
        content, calls = self._read(self.text.flush(), end=True)
        return [Delta((), content, self.index, None, self._usage(), calls)] if content or calls else []

    def completion(self) -> Completion:
        total = time.perf_counter() - self.t0
        return Completion(
            text=self.echoed + (self.text.text if self.tool_stream is None else "".join(self.content)),
            token_ids=tuple(self.tokens),
            finish_reason=self.reason if self.reason is not None else FinishReason.ABORT,
            usage=self._usage(),
            lookahead=LookaheadSummary.of(self.req.mode, self.params, self.stats),
            timings=Timings(round(1000 * (self.ttft if self.ttft is not None else total), 2), round(1000 * total, 2)),
            index=self.index,
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            tool_calls=() if self.tool_stream is None else tuple(self.tool_stream.calls),
        )

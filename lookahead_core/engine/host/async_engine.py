"""asyncio front of the engine: the engine steps on its own thread or in its own process; each
request streams its tokens."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.host.engine_loop import (
    AbortCommand,
    Accepted,
    AddCommand,
    Command,
    EngineLimits,
    EngineThread,
    Event,
    FinishCommand,
    Idle,
    Status,
    StatusCommand,
    StepFailed,
    Stepped,
    Stopped,
)
from lookahead_core.engine.io import EngineRequest, StepOutput
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.stopping import FinishReason

__all__ = ["AsyncEngine", "EngineHost", "EngineLimits", "EngineStopped", "RequestTimeout"]

log = logging.getLogger(__name__)


# The engine's status is read at most this often, whoever asks: /health's figures are at most this old.
STATUS_MAX_AGE_S = 0.5


class RequestTimeout(TimeoutError):
    """A request outlived its `timeout_s`; it has been ended (as TIMEOUT)."""


class EngineStopped(RuntimeError):
    """The engine's thread or process is gone: nothing in flight here can finish, and this
    replica's health check fails, so it gets replaced (another replica can take the request)."""


class EngineHost(Protocol):
    """Where the engine steps: `EngineThread` (a thread here) or `EngineProcess` (a process of its own)."""

    kind: str
    config: EngineConfig
    limits: EngineLimits

    def start(self, on_event: Callable[[Event], None]) -> None: ...
    def submit(self, command: Command) -> None: ...
    @property
    def alive(self) -> bool: ...
    def shutdown(self) -> None: ...


class AsyncEngine:
    """The asyncio front of an engine that steps elsewhere, so model forwards never block the event
    loop: on its own thread (`AsyncEngine(engine)`) or in its own process (`AsyncEngine(EngineProcess(...))`).

    Callers talk to it through commands only, and read what they need of its frozen config through
    `limits` and `resolve`. Its events come back on one thread (the engine's, or the process's
    reader), which hands each stream its outputs on the stream's own event loop. A step that raises
    fails the requests in flight and the engine starts clean; `failing_after` such steps in a row
    make `health_error` say the engine cannot step (the replica gets replaced).
    """

    def __init__(self, engine: Engine | EngineHost, failing_after: int = 3) -> None:
        self.host: EngineHost = EngineThread(engine) if isinstance(engine, Engine) else engine
        self.engine = engine if isinstance(engine, Engine) else None  # only where it steps in this process
        self.limits = self.host.limits
        self.failing_after = failing_after
        self.failed_steps = 0  # consecutive steps that raised
        self.last_error: str | None = None
        self.stopped: str | None = None
        self._tickets = itertools.count()
        # by ticket: requests not yet taken in (their stream's queue, their admission), status asks
        self._admissions: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue, asyncio.Future]] = {}
        self._asks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._streams: dict[str | int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._depth = (0, 0)
        self._snapshot: tuple[float, dict] | None = None  # (when read, engine_status)
        self._asking: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        self.host.start(self._on_event)

    # ---- caller side ------------------------------------------------------------------------

    async def generate(self, request: EngineRequest, timeout_s: float | None = None) -> AsyncGenerator[StepOutput, None]:
        """Yield one `StepOutput` per engine step that accepted tokens for this request.

        Raises ValueError / EngineOverloaded before the first yield if the engine refuses the
        request, and `RequestTimeout` once `timeout_s` has passed since the call (the request is
        ended as TIMEOUT). Closing the iterator early (a client gone) aborts the request, unless
        the caller ended it first with `finish`.
        """
        seq_id = request.request_id
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        queue: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        ticket = next(self._tickets)
        self._admissions[ticket] = (loop, queue, accepted)
        self._submit(AddCommand(ticket, request))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(seq_id)  # the engine may have taken it in already
            raise
        done = False
        try:
            while not done:
                try:
                    item = await _next(queue, loop, deadline, timeout_s)
                except RequestTimeout:
                    done = True
                    self.finish(seq_id, FinishReason.TIMEOUT)
                    raise
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finish_reason is not None
                yield item
        finally:
            if not done:
                self.abort(seq_id)

    def resolve(self, request: EngineRequest) -> LookaheadParams | None:
        """The (N, W, G) the request runs; ValueError past the engine's limits (its frozen config)."""
        return self.host.config.resolve(request.lookahead)

    def abort(self, seq_id: str | int) -> None:
        self._submit(AbortCommand(seq_id))

    def finish(self, seq_id: str | int, reason: FinishReason, kept: int | None = None) -> None:
        """End a request for the caller's reason, its text kept up to `kept` new tokens (`Engine.finish`).
        Its stream still ends with an output that has the finish reason and the request's stats."""
        self._submit(FinishCommand(seq_id, reason, kept))

    async def status(self, max_age_s: float = STATUS_MAX_AGE_S, timeout_s: float = 2.0) -> dict:
        """`engine_status`, read where the engine steps at most once per `max_age_s` (callers in
        between share the last read, so probes cannot add to the engine's steps); past `timeout_s`
        (a long step), the last read with its `age_s`. TimeoutError where there is none yet."""
        loop = asyncio.get_running_loop()
        if self._snapshot is not None and time.monotonic() - self._snapshot[0] <= max_age_s:
            return self._snapshot[1]
        if self._asking is not None and self._asking[0] is loop and not self._asking[1].done():
            answer = self._asking[1]
        else:
            answer = loop.create_future()
            ticket = next(self._tickets)
            self._asks[ticket] = (loop, answer)
            self._asking = (loop, answer)
            self._submit(StatusCommand(ticket))
        try:
            status = await asyncio.wait_for(asyncio.shield(answer), timeout_s)
        except TimeoutError:
            if self._snapshot is None:
                raise
            read_at, last = self._snapshot
            return {**last, "age_s": round(time.monotonic() - read_at, 3)}
        self._snapshot = (time.monotonic(), status)
        return status

    def queue_depth(self) -> tuple[int, int]:
        """(running, waiting) as of the engine's last step, plus requests not yet taken in."""
        running, waiting = self._depth
        return running, waiting + len(self._admissions)

    @property
    def alive(self) -> bool:
        """False once the engine's thread or process has died or been shut down."""
        return self.host.alive and self.stopped is None

    def health_error(self) -> str | None:
        """Why this engine cannot serve, or None: its thread or process is gone, or its last steps all raised."""
        if not self.alive:
            return f"the engine {self.host.kind} is not running"
        if self.failed_steps >= self.failing_after:
            return f"the engine's last {self.failed_steps} steps raised; the last: {self.last_error}"
        return None

    def shutdown(self) -> None:
        self.host.shutdown()

    def _submit(self, command: Command) -> None:
        if self.stopped is None:
            self.host.submit(command)
        else:
            self._on_event(Stopped(self.stopped))  # nobody will answer: settle what waits now

    # ---- events, on the engine's thread or the process's reader ------------------------------

    def _on_event(self, event: Event) -> None:
        if isinstance(event, Stepped):
            self._depth, self.failed_steps = event.depth, 0
            for out in event.outputs:
                self._deliver(out.seq_id, out, final=out.finish_reason is not None)
        elif isinstance(event, Accepted):
            self._accepted(event)
        elif isinstance(event, Idle):
            self._depth = event.depth
        elif isinstance(event, Status):
            ask = self._asks.pop(event.ticket, None)
            if ask is not None:
                _call_soon(ask[0], _settle, ask[1], None, event.status)
        elif isinstance(event, StepFailed):
            self._depth = event.depth
            self.failed_steps += 1
            self.last_error = f"{event.kind}: {event.error}"
            self._end_streams(RuntimeError(f"engine step failed: {event.error}"))
        elif isinstance(event, Stopped):
            self.stopped = event.reason
            error = EngineStopped(event.reason)
            # a caller waiting on its admission or an answer must hear
            for loop, future in _drain(self._admissions) + _drain(self._asks):
                _call_soon(loop, _settle, future, error)
            self._end_streams(error)

    def _accepted(self, event: Accepted) -> None:
        admission = self._admissions.pop(event.ticket, None)
        if admission is None:  # settled already: the engine stopped meanwhile
            return
        loop, queue, accepted = admission
        if event.error is not None:
            _call_soon(loop, _settle, accepted, event.error)
        elif _call_soon(loop, _settle, accepted, None):
            self._streams[event.seq_id] = (loop, queue)
        else:  # the caller's event loop is gone
            self._submit(AbortCommand(event.seq_id))

    def _deliver(self, seq_id, item, final: bool) -> None:
        target = self._streams.pop(seq_id, None) if final else self._streams.get(seq_id)
        if target is not None:
            loop, queue = target
            if not _call_soon(loop, queue.put_nowait, item):  # the caller's loop is gone: nobody listens
                self._streams.pop(seq_id, None)
                # queued behind the caller's own last word (a finish it sent before leaving)
                self._submit(AbortCommand(seq_id))

    def _end_streams(self, error: RuntimeError) -> None:
        for seq_id in list(self._streams):
            self._deliver(seq_id, error, final=True)


async def _next(queue: asyncio.Queue, loop: asyncio.AbstractEventLoop, deadline: float | None, timeout_s: float | None):
    """The next item of a request's queue; RequestTimeout once its deadline has passed."""
    if deadline is None:
        return await queue.get()
    try:
        return await asyncio.wait_for(queue.get(), max(deadline - loop.time(), 0))
    except TimeoutError:
        raise RequestTimeout(f"request timed out after {timeout_s:g} s") from None


def _drain(waiting: dict) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]:
    """Empty `waiting` (ticket -> (loop, ..., future)): each entry's loop and future. Safe while
    another thread drains it too: each entry is taken once."""
    out: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
    while True:
        try:
            _, entry = waiting.popitem()
        except KeyError:
            return out
        out.append((entry[0], entry[-1]))


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """Schedule fn on the caller's loop; False if that loop is closed (the engine thread must not die)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def _settle(future: asyncio.Future, exc: BaseException | None, result=None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)

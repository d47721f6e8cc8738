"""asyncio front of the engine: a background thread steps it; each request streams its tokens."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from lookahead_core.engine.engine import Engine
from lookahead_core.engine.request import EngineRequest
from lookahead_core.engine.verification import StepOutput
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.stopping import FinishReason

log = logging.getLogger(__name__)


class RequestTimeout(TimeoutError):
    """A request outlived its `timeout_s`; it has been ended (as TIMEOUT)."""


@dataclass(frozen=True)
class EngineLimits:
    """The most one request may ask of the engine: new tokens, and prompt plus new tokens."""

    max_new_tokens: int
    max_seq_len: int


# ---- commands from callers to the engine thread ------------------------------------------------

@dataclass(frozen=True)
class AddCommand:
    """Queue a request; `accepted` settles once the engine took it in (or refused it, with the error),
    then its StepOutputs go to `queue` on the caller's `loop`."""

    request: EngineRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    accepted: asyncio.Future


@dataclass(frozen=True)
class AbortCommand:
    seq_id: str | int


@dataclass(frozen=True)
class FinishCommand:
    """The caller ended a request (a stop string, its deadline): see `Engine.finish`."""

    seq_id: str | int
    reason: FinishReason
    kept: int | None = None


Command = AddCommand | AbortCommand | FinishCommand


class AsyncEngine:
    """Owns an `Engine` on a dedicated thread, so model forwards never block the event loop.

    Every engine call happens on that thread; callers talk to it through a command queue, and
    read what they need of its frozen config through `limits` and `resolve`, never through `engine`.
    A step that raises fails the requests in flight and the engine starts clean; `failing_after`
    such steps in a row make `health_error` say the engine cannot step (the replica gets replaced).
    """

    def __init__(self, engine: Engine, failing_after: int = 3) -> None:
        self.engine = engine
        self.limits = EngineLimits(engine.config.max_new_tokens, engine.max_seq_len)
        self.failing_after = failing_after
        self.failed_steps = 0  # consecutive steps that raised
        self.last_error: str | None = None
        self._commands: deque[Command] = deque()
        self._wake = threading.Event()
        self._streams: dict[str | int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._depth = (0, 0)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lookahead-engine", daemon=True)
        self._thread.start()

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
        self._submit(AddCommand(request, loop, queue, accepted))
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
        """The (N, W, G) the request runs; ValueError past the engine's limits. Safe from any
        thread: `Engine.resolve` reads the request and the engine's frozen config only."""
        return self.engine.resolve(request)

    def abort(self, seq_id: str | int) -> None:
        self._submit(AbortCommand(seq_id))

    def finish(self, seq_id: str | int, reason: FinishReason, kept: int | None = None) -> None:
        """End a request for the caller's reason, its text kept up to `kept` new tokens (`Engine.finish`).
        Its stream still ends with an output that has the finish reason and the request's stats."""
        self._submit(FinishCommand(seq_id, reason, kept))

    def queue_depth(self) -> tuple[int, int]:
        """(running, waiting) as of the engine's last step, plus requests not yet taken in."""
        running, waiting = self._depth
        return running, waiting + sum(1 for c in list(self._commands) if isinstance(c, AddCommand))

    @property
    def alive(self) -> bool:
        """False once the engine thread has died or been shut down."""
        return self._thread.is_alive() and not self._stopping

    def health_error(self) -> str | None:
        """Why this engine cannot serve, or None: its thread is gone, or its last steps all raised."""
        if not self.alive:
            return "the engine thread is not running"
        if self.failed_steps >= self.failing_after:
            return f"the engine's last {self.failed_steps} steps raised; the last: {self.last_error}"
        return None

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _submit(self, command: Command) -> None:
        self._commands.append(command)
        self._wake.set()

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # a caller waiting on its admission or its stream must hear, not wait forever
            error = RuntimeError("the engine thread stopped")
            while self._commands:
                cmd = self._commands.popleft()
                if isinstance(cmd, AddCommand):
                    _call_soon(cmd.loop, _settle, cmd.accepted, error)
            self._end_streams(error)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._drain_commands()
            if not engine.has_work():
                self._depth = engine.queue_depth()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # keep serving: fail what was in flight, start clean
                log.exception("engine step failed")
                self.failed_steps += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._fail_all(exc)
                continue
            self.failed_steps = 0
            self._depth = engine.queue_depth()
            for out in outputs:
                self._deliver(out.seq_id, out, final=out.finish_reason is not None)

    def _drain_commands(self) -> None:
        engine = self.engine
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, AddCommand):
                seq_id = cmd.request.request_id
                try:
                    engine.add_request(cmd.request)
                except Exception as exc:
                    _call_soon(cmd.loop, _settle, cmd.accepted, exc)
                    continue
                if _call_soon(cmd.loop, _settle, cmd.accepted, None):
                    self._streams[seq_id] = (cmd.loop, cmd.queue)
                else:  # the caller's event loop is gone
                    engine.abort(seq_id)
            elif isinstance(cmd, AbortCommand):
                engine.abort(cmd.seq_id)
            else:
                engine.finish(cmd.seq_id, cmd.reason, cmd.kept)

    def _deliver(self, seq_id, item, final: bool) -> None:
        target = self._streams.pop(seq_id, None) if final else self._streams.get(seq_id)
        if target is not None:
            loop, queue = target
            if not _call_soon(loop, queue.put_nowait, item):  # the caller's loop is gone: nobody listens
                self._streams.pop(seq_id, None)
                # queued behind the caller's own last word (a finish it sent before leaving)
                self._submit(AbortCommand(seq_id))

    def _fail_all(self, exc: Exception) -> None:
        self.engine.abort_all()
        self._end_streams(RuntimeError(f"engine step failed: {exc}"))

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


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """Schedule fn on the caller's loop; False if that loop is closed (the engine thread must not die)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)

"""The engine side of `AsyncEngine`: commands in, steps, events out, on the engine's own thread
(`EngineThread`) or in its own process (`engine_process.EngineProcess`). Commands and events are
plain picklable values: the two hosts differ only in how they carry them."""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lookahead_core.engine.engine import Engine
from lookahead_core.engine.host.status import engine_status
from lookahead_core.engine.io import EngineRequest, StepOutput
from lookahead_core.lookahead.stopping import FinishReason

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLimits:
    """The most one request may ask of the engine: new tokens, and prompt plus new tokens."""

    max_new_tokens: int
    max_seq_len: int


# ---- commands: caller -> engine ---------------------------------------------------------------

@dataclass(frozen=True)
class AddCommand:
    """Queue a request; the engine answers with `Accepted` for the same ticket."""

    ticket: int
    request: EngineRequest


@dataclass(frozen=True)
class AbortCommand:
    seq_id: str | int


@dataclass(frozen=True)
class FinishCommand:
    """The caller ended a request (a stop string, its deadline): see `Engine.finish`."""

    seq_id: str | int
    reason: FinishReason
    kept: int | None = None


@dataclass(frozen=True)
class StatusCommand:
    """Ask for `engine_status`, answered with `Status` for the same ticket."""

    ticket: int


@dataclass(frozen=True)
class StopCommand:
    """End the loop (the host is shutting down)."""


Command = AddCommand | AbortCommand | FinishCommand | StatusCommand | StopCommand


# ---- events: engine -> caller -----------------------------------------------------------------

@dataclass(frozen=True)
class Accepted:
    """The engine took the request in (error None) or refused it (ValueError, EngineOverloaded)."""

    ticket: int
    seq_id: str | int
    error: BaseException | None


@dataclass(frozen=True)
class Stepped:
    outputs: list[StepOutput]
    depth: tuple[int, int]  # (running, waiting) after the step


@dataclass(frozen=True)
class StepFailed:
    """A step raised: the requests in flight are failed and the engine starts clean."""

    error: str  # the exception's message
    kind: str  # its type's name
    depth: tuple[int, int]


@dataclass(frozen=True)
class Idle:
    depth: tuple[int, int]


@dataclass(frozen=True)
class Status:
    ticket: int
    status: dict[str, Any]


@dataclass(frozen=True)
class Stopped:
    """The engine's thread or process is gone; `reason` ends every open stream."""

    reason: str


Event = Accepted | Stepped | StepFailed | Idle | Status | Stopped


class EngineLoop:
    """Steps `engine` while it has work, between batches of commands. `commands(timeout)` returns the
    commands that arrived (waiting up to `timeout` seconds for one; None: not at all); `emit` sends
    one event; `pending()` says whether a command waits (work done while idle stops for it within
    one graph call). Returns on a StopCommand."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def run(self, commands: Callable[[float | None], list[Command]], emit: Callable[[Event], None],
            pending: Callable[[], bool] = lambda: False) -> None:
        engine, depth = self.engine, None
        while True:
            busy = engine.has_work() or engine.idle_turn(pending)  # after a timing, only a look for commands
            for cmd in commands(None if busy else 0.5):
                if isinstance(cmd, StopCommand):
                    engine.close()
                    return
                self._handle(cmd, emit)
            if not engine.has_work():
                if engine.queue_depth() != depth:
                    depth = engine.queue_depth()
                    emit(Idle(depth))
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # keep serving: fail what was in flight, start clean
                log.exception("engine step failed")
                engine.abort_all()
                depth = engine.queue_depth()
                emit(StepFailed(str(exc), type(exc).__name__, depth))
                continue
            depth = engine.queue_depth()
            emit(Stepped(outputs, depth))

    def _handle(self, cmd: Command, emit: Callable[[Event], None]) -> None:
        engine = self.engine
        if isinstance(cmd, AddCommand):
            try:
                engine.add_request(cmd.request)
            except Exception as exc:
                emit(Accepted(cmd.ticket, cmd.request.request_id, exc))
                return
            emit(Accepted(cmd.ticket, cmd.request.request_id, None))
        elif isinstance(cmd, AbortCommand):
            engine.abort(cmd.seq_id)
        elif isinstance(cmd, FinishCommand):
            engine.finish(cmd.seq_id, cmd.reason, cmd.kept)
        elif isinstance(cmd, StatusCommand):
            emit(Status(cmd.ticket, engine_status(engine)))


class EngineThread:
    """The engine stepping on a thread of the caller's process (tests, the library, a replica
    with `engine_process: false`)."""

    kind = "thread"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config = engine.config
        self.limits = EngineLimits(engine.config.max_new_tokens, engine.max_seq_len)
        self._commands: deque[Command] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self, on_event: Callable[[Event], None]) -> None:
        def run() -> None:
            try:
                EngineLoop(self.engine).run(self._take, on_event, lambda: bool(self._commands) or self._stopping)
            finally:
                on_event(Stopped("the engine thread stopped"))

        self._thread = threading.Thread(target=run, name="lookahead-engine", daemon=True)
        self._thread.start()

    def submit(self, command: Command) -> None:
        self._commands.append(command)
        self._wake.set()

    def _take(self, timeout: float | None) -> list[Command]:
        if not self._commands and timeout:
            self._wake.wait(timeout)
        self._wake.clear()
        out = []
        while self._commands:
            out.append(self._commands.popleft())
        if self._stopping:
            out.append(StopCommand())
        return out

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

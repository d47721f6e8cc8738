"""The engine in a process of its own, as vLLM's engine core runs apart from its API server.

In the replica's process the engine thread shares one GIL with the event loop, Ray's streaming and
the text work of every request: each time a step's Python (the planner, the graph's wrapper, the
verdicts) waits for the GIL, the step waits (CHANGELOG.md, "The engine in its own process":
a Python thread busy beside the engine slowed its step, a busy process did not). Here the engine
owns its process: it takes commands and sends events (engine_loop.py) over one pipe, and a reader
thread in the caller's process hands them to `AsyncEngine`. The process also holds its own
priority: its threads above the HTTP stack's.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.host.engine_loop import Command, EngineLimits, EngineLoop, Event, StopCommand, Stopped

Build = Callable[[], tuple[Engine, dict[str, Any]]]


@dataclass(frozen=True)
class Ready:
    """The engine is built (and warmed up): what its caller needs of it without asking again."""

    config: EngineConfig
    limits: EngineLimits
    facts: dict[str, Any]  # whatever `build` returned beside the engine


@dataclass(frozen=True)
class BuildFailed:
    error: BaseException


class EngineProcess:
    """Starts a process that runs `build()` (a picklable callable returning the engine and facts for
    the caller) and steps the engine there; blocks until it is built. An error in `build` is
    raised here. `facts` holds what it returned beside the engine."""

    kind = "process"

    def __init__(self, build: Build, name: str = "lookahead-engine") -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs threads (Ray, torch)
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_main, args=(build, child), name=name)
        self._process.start()
        child.close()
        try:
            ready = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise RuntimeError(f"the engine process exited while starting (exit code {self._process.exitcode})") from None
        if isinstance(ready, BuildFailed):
            self._process.join(10)
            raise ready.error
        self.config, self.limits, self.facts = ready.config, ready.limits, ready.facts
        self.pid = self._process.pid
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader: threading.Thread | None = None

    def start(self, on_event: Callable[[Event], None]) -> None:
        def read() -> None:
            while True:
                try:
                    event = self._conn.recv()
                except (EOFError, OSError):
                    break
                on_event(event)
            on_event(Stopped("the engine process stopped"))

        self._reader = threading.Thread(target=read, name="lookahead-engine-events", daemon=True)
        self._reader.start()

    def submit(self, command: Command) -> None:
        with self._send_lock:  # callers on any thread; one message at a time on the pipe
            try:
                self._conn.send(command)
            except (BrokenPipeError, OSError):
                pass  # the process is gone: the reader reports it

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and not self._stopping

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self.submit(StopCommand())
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()


def _main(build: Build, conn: Connection) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s engine[{os.getpid()}] %(levelname)s %(message)s")
    try:
        engine, facts = build()
    except BaseException as exc:  # the caller raises it, named; a value that will not pickle goes as text
        try:
            conn.send(BuildFailed(exc))
        except Exception:
            conn.send(BuildFailed(RuntimeError(f"{type(exc).__name__}: {exc}")))
        return
    conn.send(Ready(engine.config, EngineLimits(engine.config.max_new_tokens, engine.max_seq_len), facts))

    def commands(timeout: float | None) -> list[Command]:
        out: list[Command] = []
        try:
            if conn.poll(timeout or 0):
                while True:
                    out.append(conn.recv())
                    if not conn.poll(0):
                        break
        except (EOFError, OSError):  # the caller's process is gone
            out.append(StopCommand())
        return out

    def pending() -> bool:
        try:
            return conn.poll(0)
        except (EOFError, OSError):
            return True

    try:
        EngineLoop(engine).run(commands, conn.send, pending)
    except (BrokenPipeError, OSError):
        pass  # the caller's process is gone

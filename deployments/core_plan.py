"""Where a model replica's engine threads run: how many torch threads, and at what priority.

A decode step is a parallel region: it is as slow as its slowest thread, so one thread preempted by
the HTTP stack (Serve's proxy, the ingress, the replica's own event loop, Ray's processes, a client
on the same machine) stalls the whole step. The rules, measured in CHANGELOG.md ("Core plan"):

* A replica that asks for every core this machine gives it, with the engine in a process of its own,
  runs every step on all of them: the HTTP stack streams from HAProxy and the replica's own server
  at a fraction of a core, above Ray's priority (`http_nice`), and a step of any batch measured
  faster on every core (CHANGELOG.md, "Every step on every core").
* Where the engine steps in the replica's process (`engine_process: false`) or is bound to cores
  (`pin_cores`), such a replica leaves one core to the HTTP stack: torch runs `cores - 1` threads,
  except a step of LARGE_BATCH sequences or more and a prompt chunk, which run on all of them unless
  bound (`large_batch_threads`; such a forward is long, and the HTTP stack catches up between them).
* A replica given fewer cores than the machine has (a cluster node, `num_cpus` below the core
  count) runs one thread per core it asked for.
* Ray starts actors at nice 15 and its own raylet and GCS at nice 0, so every Ray heartbeat would
  preempt a step. The engine's threads move to `nice` (0 by default), where the process may raise
  its priority (root or CAP_SYS_NICE).
* The HTTP stack on the replica's node moves to `http_nice` (5 by default): the replica's own
  process (its event loop and streams, with the engine in a process of its own) and Serve's proxy,
  or with Serve's HAProxy ingress HAProxy and the actor that starts it, of this Ray node and user
  alone (`apply_http`, in the replica's process; `serve_proxies`). Left at Ray's 15, a step on
  every core starved them (first tokens came far later than in-process at 16 users); at the
  engine's 0 they preempt its steps more (CHANGELOG.md, "The HTTP stack above Ray's priority").
* `pin_cores` (off by default) binds the engine's stepping thread to its threads' cores and the
  HTTP stack on its node to the rest, as vLLM's CPU server binds its model thread; every step then
  runs on `torch_threads`. On two cores it served as fast as the unbound plan with one thread
  (CHANGELOG.md, "One thread bound to one core"), so it stays an option.

The plan is applied where the engine steps (`apply`: in the engine's process, or the replica's).
`torch_threads` in the app args overrides the thread rule; `nice: null` and `http_nice: null` leave
Ray's priority.
`large_batch_threads` in the app args sets the threads of a step of LARGE_BATCH sequences or more
(its compiled graphs are compiled for them; `StepThreads`).
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import asdict, dataclass

import torch

from lookahead_core.engine.runner.step_threads import StepThreads

LARGE_BATCH = 8
PROXY_TITLE = b"ray::ProxyActor"  # the process title Ray gives Serve's proxy actor
HAPROXY_TITLE = b"ray::HAProxyManager"  # Serve's HAProxy ingress: the actor that starts (and reloads) HAProxy
HAPROXY_NAME = b"haproxy"  # the HAProxy binary it starts
log = logging.getLogger("ray.serve")


def visible_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class CorePlan:
    cores: int                 # cores visible to the replica
    num_cpus: float            # what the replica asked Ray for
    torch_threads: int
    nice: int | None           # priority asked for the engine's threads (None: Ray's)
    reason: str
    own_process: bool = True   # the engine steps in a process of its own (which `apply` runs in)
    large_batch_threads: int | None = None  # torch threads of a step of LARGE_BATCH sequences or more
    http_nice: int | None = 5  # priority asked for the replica's event loop and Serve's proxy (None: Ray's)
    engine_cores: tuple[int, ...] | None = None  # the engine's stepping thread bound to these (None: not bound)
    http_cores: tuple[int, ...] | None = None    # and the HTTP stack on this node to these

    @classmethod
    def build(cls, num_cpus: float, torch_threads: int | None = None, nice: int | None = 0,
              cores: int | None = None, own_process: bool = True, large_batch_threads: int | None = None,
              http_nice: int | None = 5, pin_cores: bool = False) -> CorePlan:
        ids = visible_cores()
        ids = ids if not cores else ids[:cores] if len(ids) >= cores else tuple(range(cores))
        cores, asked = len(ids), max(1, int(num_cpus))
        if torch_threads is not None:
            threads, reason = torch_threads, "torch_threads set in the app args"
        elif asked >= cores > 1 and own_process and not pin_cores:
            threads, reason = cores, f"the replica has all {cores} cores and the engine a process of its own: every step on all {cores}"
        elif asked >= cores > 1:
            threads, reason = cores - 1, f"the replica has all {cores} cores: one is left to the HTTP stack"
            if large_batch_threads is None and not pin_cores:
                large_batch_threads = cores
                reason += f", but a step of {LARGE_BATCH} sequences or more runs on all {cores}"
        else:
            threads, reason = min(asked, cores), f"one thread per core asked for (num_cpus {num_cpus:g})"
        engine_cores = http_cores = None
        if pin_cores:
            widest = max(threads, large_batch_threads or threads)
            if not (own_process and asked >= cores > widest):
                raise ValueError(
                    f"pin_cores binds the engine to {widest} of this node's {cores} cores and the HTTP stack to the "
                    f"rest: it needs engine_process true, num_cpus >= {cores} (got {num_cpus:g}) and every step on "
                    f"fewer threads than cores (torch_threads {threads}, large_batch_threads {large_batch_threads})")
            engine_cores, http_cores = ids[:widest], ids[widest:]
            reason += f"; the engine bound to cores {list(engine_cores)}, the HTTP stack to {list(http_cores)}"
        return cls(cores, num_cpus, threads, nice, reason, own_process, large_batch_threads, http_nice,
                   engine_cores, http_cores)

    def step_threads(self) -> StepThreads:
        """The engine's threads per forward: `torch_threads`, or `large_batch_threads` from
        LARGE_BATCH sequences up."""
        compile_cores = None if self.engine_cores is None else frozenset(self.engine_cores + (self.http_cores or ()))
        if self.large_batch_threads is None or self.large_batch_threads == self.torch_threads:
            return StepThreads(self.torch_threads, compile_cores=compile_cores)
        return StepThreads(self.torch_threads, LARGE_BATCH, self.large_batch_threads, compile_cores)

    def apply(self) -> dict:
        """Set torch's threads, this process's priority and (`engine_cores`) the cores of the calling
        thread, the one that steps, and of those it starts; returns what took effect (for /health)."""
        torch.set_num_threads(self.torch_threads)
        applied = renice(self.nice) if self.nice is not None else None
        if self.engine_cores is not None:
            os.sched_setaffinity(0, self.engine_cores)
        status = {**asdict(self), "nice_now": os.getpriority(os.PRIO_PROCESS, 0)}
        if self.nice is not None and applied != self.nice:
            status["nice_error"] = f"could not set nice {self.nice} (no CAP_SYS_NICE): the replica stays at {applied}"
            log.warning("core plan: %s", status["nice_error"])
        return status


    def apply_http(self) -> dict:
        """Move the HTTP stack on this node to `http_nice`: this process (the replica's, when the
        engine steps in another) and Serve's proxies here. Returns what took effect (for /health)."""
        pids = ([] if not self.own_process else [("replica", os.getpid())]) + serve_proxies()
        status: dict = {}
        if self.http_cores is not None:
            status["http_cores_now"] = {name: bind(self.http_cores, pid) for name, pid in pids}
        if self.http_nice is None:
            return status
        status["http_nice_now"] = {name: renice(self.http_nice, pid) for name, pid in pids}
        if any(n != self.http_nice for n in status["http_nice_now"].values()):
            status["http_nice_error"] = (f"could not set nice {self.http_nice} on the HTTP stack (no CAP_SYS_NICE): "
                                         "under load a step on every core delays its streams")
            log.warning("core plan: %s", status["http_nice_error"])
        return status


def serve_proxies(node: int | None = None) -> list[tuple[str, int]]:
    """(name, pid) of Serve's HTTP proxies of this Ray node (Ray names an actor's process after its
    class): its proxy actor, or with its HAProxy ingress the HAProxy processes and the actor that
    starts them (a reloaded HAProxy is its child, and inherits its priority and cores). Only this
    user's, below `node` (default: this process's parent, the raylet that starts every worker):
    another Ray's proxies on this host, or a system HAProxy, are not the replica's to move."""
    node, uid = os.getppid() if node is None else node, os.getuid()
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv0 = f.read(512).split(b"\0", 1)[0]
                if argv0.startswith(PROXY_TITLE):
                    name = "proxy"
                elif argv0.startswith(HAPROXY_TITLE) or os.path.basename(argv0) == HAPROXY_NAME:
                    name = "haproxy"
                else:
                    continue
                if os.stat(f"/proc/{entry}").st_uid == uid and _below(int(entry), node):
                    found.append((f"{name} {entry}", int(entry)))
    return found


def _below(pid: int, node: int, depth: int = 3) -> bool:
    """Whether `node` is among the first `depth` ancestors of `pid` (HAProxy: raylet -> its manager -> it)."""
    for _ in range(depth):
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        if pid == node:
            return True
    return False


def bind(cores: tuple[int, ...], pid: int) -> list[int]:
    """Every thread of process `pid` to `cores` (affinity too is per thread; later threads inherit
    their creator's). Returns the process's cores afterwards."""
    for tid in _threads(pid):
        with contextlib.suppress(OSError):  # a thread may have exited
            os.sched_setaffinity(tid, cores)
    try:
        return sorted(os.sched_getaffinity(pid))
    except OSError:
        return list(cores)


def renice(nice: int, pid: int | None = None) -> int:
    """Every thread of process `pid` (default: this one) to `nice` (Linux keeps a priority per
    thread; threads started later inherit their creator's). Returns the process's priority
    afterwards."""
    for tid in _threads(pid):
        with contextlib.suppress(OSError):  # raising priority needs CAP_SYS_NICE; a thread may have exited
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    try:
        return os.getpriority(os.PRIO_PROCESS, pid or 0)
    except OSError:  # the process exited meanwhile
        return nice


def _threads(pid: int | None = None) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid or 'self'}/task")]
    except OSError:
        return [pid or 0]

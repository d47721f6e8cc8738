"""Where a model replica's engine threads run: how many torch threads, and at what priority.

A decode step is a parallel region: it is as slow as its slowest thread, so one thread preempted by
the HTTP stack (Serve's proxy, the ingress, the replica's own event loop, Ray's processes, a client
on the same machine) stalls the whole step. The rules, measured in docs/BENCHMARKS.md ("Core plan"):

* A replica that asks for every core this machine gives it leaves one to the HTTP stack: torch runs
  `cores - 1` threads (at least one). A replica given fewer cores than the machine has (a cluster
  node, `num_cpus` below the core count) runs one thread per core it asked for. This holds with the
  engine in a process of its own too: there, a thread on every core starved the HTTP stack.
* Except a step of LARGE_BATCH sequences or more, and a prompt chunk, where the replica has every
  core: they run on all of them (`large_batch_threads`). Such a forward is long, and the HTTP stack
  catches up between them (CHANGELOG.md, "Graphs as packages on disk").
* Ray starts actors at nice 15 and its own raylet and GCS at nice 0, so every Ray heartbeat would
  preempt a step. The engine's threads move to `nice` (0 by default), where the process may raise
  its priority (root or CAP_SYS_NICE).
* The HTTP stack on the replica's node moves to `http_nice` (5 by default): the replica's own
  process (its event loop and streams, with the engine in a process of its own) and Serve's proxy
  (`apply_http`, in the replica's process). Left at Ray's 15, a step on every core starved them
  (a request's first token came 8x later than in-process at 16 users); at the engine's 0 they
  preempt its steps more (docs/BENCHMARKS.md, "The HTTP stack above Ray's priority").

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

from lookahead_core.engine.step_threads import StepThreads

LARGE_BATCH = 8
PROXY_TITLE = b"ray::ProxyActor"  # the process title Ray gives Serve's proxy actor
log = logging.getLogger("ray.serve")


def visible_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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

    @classmethod
    def build(cls, num_cpus: float, torch_threads: int | None = None, nice: int | None = 0,
              cores: int | None = None, own_process: bool = True, large_batch_threads: int | None = None,
              http_nice: int | None = 5) -> CorePlan:
        cores = cores or visible_cores()
        asked = max(1, int(num_cpus))
        if torch_threads is not None:
            threads, reason = torch_threads, "torch_threads set in the app args"
        elif asked >= cores > 1:
            threads, reason = cores - 1, f"the replica has all {cores} cores: one is left to the HTTP stack"
            if large_batch_threads is None:
                large_batch_threads = cores
                reason += f", but a step of {LARGE_BATCH} sequences or more runs on all {cores}"
        else:
            threads, reason = min(asked, cores), f"one thread per core asked for (num_cpus {num_cpus:g})"
        return cls(cores, num_cpus, threads, nice, reason, own_process, large_batch_threads, http_nice)

    def step_threads(self) -> StepThreads:
        """The engine's threads per forward: `torch_threads`, or `large_batch_threads` from
        LARGE_BATCH sequences up."""
        if self.large_batch_threads is None or self.large_batch_threads == self.torch_threads:
            return StepThreads(self.torch_threads)
        return StepThreads(self.torch_threads, LARGE_BATCH, self.large_batch_threads)

    def apply(self) -> dict:
        """Set torch's threads and this process's priority (the engine's process); returns what took
        effect (for /health)."""
        torch.set_num_threads(self.torch_threads)
        applied = renice(self.nice) if self.nice is not None else None
        status = {**asdict(self), "nice_now": os.getpriority(os.PRIO_PROCESS, 0)}
        if self.nice is not None and applied != self.nice:
            status["nice_error"] = f"could not set nice {self.nice} (no CAP_SYS_NICE): the replica stays at {applied}"
            log.warning("core plan: %s", status["nice_error"])
        return status


    def apply_http(self) -> dict:
        """Move the HTTP stack on this node to `http_nice`: this process (the replica's, when the
        engine steps in another) and Serve's proxies here. Returns what took effect (for /health)."""
        if self.http_nice is None:
            return {}
        pids = ([] if not self.own_process else [os.getpid()]) + serve_proxies()
        now = {pid: renice(self.http_nice, pid) for pid in pids}
        status: dict = {"http_nice_now": {"replica" if pid == os.getpid() else f"proxy {pid}": n for pid, n in now.items()}}
        if any(n != self.http_nice for n in now.values()):
            status["http_nice_error"] = (f"could not set nice {self.http_nice} on the HTTP stack (no CAP_SYS_NICE): "
                                         "under load a step on every core delays its streams")
            log.warning("core plan: %s", status["http_nice_error"])
        return status


def serve_proxies() -> list[int]:
    """Pids of Serve's HTTP proxies on this node (Ray names an actor's process after its class)."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read(64).startswith(PROXY_TITLE):
                        pids.append(int(entry))
    return pids


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

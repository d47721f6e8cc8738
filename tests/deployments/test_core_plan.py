"""The replica's core plan: how many torch threads on how many cores, and the priority it takes."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from deployments.config import AppArgs
from deployments.core_plan import CorePlan


def test_a_replica_with_every_core_and_the_engine_in_its_own_process_steps_on_all_of_them():
    plan = CorePlan.build(num_cpus=2, cores=2)
    assert plan.torch_threads == 2 and plan.large_batch_threads is None and "every step on all 2" in plan.reason
    assert [plan.step_threads().for_batch(b) for b in (1, 7, 8, 16)] == [2, 2, 2, 2]
    assert plan.step_threads().for_batch(1, prefill=True) == 2
    assert CorePlan.build(num_cpus=16, cores=16).torch_threads == 16
    assert CorePlan.build(num_cpus=1, cores=1).torch_threads == 1


def test_a_replica_with_every_core_and_the_engine_on_its_thread_leaves_one_to_the_http_stack():
    plan = CorePlan.build(num_cpus=2, cores=2, own_process=False)
    assert plan.torch_threads == 1 and "one is left to the HTTP stack" in plan.reason
    assert CorePlan.build(num_cpus=16, cores=16, own_process=False).torch_threads == 15


def test_a_replica_with_part_of_the_machine_runs_a_thread_per_core_it_asked_for():
    assert CorePlan.build(num_cpus=4, cores=16).torch_threads == 4
    assert CorePlan.build(num_cpus=0, cores=16).torch_threads == 1
    assert CorePlan.build(num_cpus=0.5, cores=2).torch_threads == 1


def test_torch_threads_in_the_app_args_override_the_rule():
    plan = AppArgs(num_cpus=2, torch_threads=1).core_plan(cores=2)
    assert plan.torch_threads == 1 and "torch_threads" in plan.reason
    assert AppArgs(num_cpus=2).core_plan(cores=2).torch_threads == 2
    assert AppArgs().nice == 0 and AppArgs(nice=None).core_plan(cores=2).nice is None


def test_where_one_core_is_left_steps_of_many_sequences_run_on_all_of_them():
    plan = AppArgs(num_cpus=2, engine_process=False).core_plan(cores=2)
    threads = plan.step_threads()
    assert plan.torch_threads == 1 and [threads.for_batch(b) for b in (1, 7, 8, 16)] == [1, 1, 2, 2]
    assert threads.for_batch(1, prefill=True) == 2
    assert AppArgs(num_cpus=2, engine_process=False, large_batch_threads=1).core_plan(cores=2).step_threads().for_batch(16) == 1
    assert AppArgs(num_cpus=2, torch_threads=1, large_batch_threads=2).core_plan(cores=2).step_threads().for_batch(16) == 2
    assert AppArgs(num_cpus=2, large_batch_threads=1).core_plan(cores=2).step_threads().for_batch(16) == 1
    assert AppArgs(num_cpus=4).core_plan(cores=16).step_threads().for_batch(16) == 4  # part of the machine


def test_apply_sets_the_threads_and_the_priority_of_every_thread_of_the_process():
    # In a child process: the priority is the process's own, and lowering it cannot be undone without privilege.
    code = """
import json, os, threading
from deployments.core_plan import CorePlan
t = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True); t.start()
status = CorePlan.build(num_cpus=2, torch_threads=1, nice=7, cores=2).apply()
import torch
threads = [os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir('/proc/self/task')]
later = []
w = threading.Thread(target=lambda: later.append(os.getpriority(os.PRIO_PROCESS, 0))); w.start(); w.join()
print(json.dumps({"status": status, "threads": threads, "later": later, "torch": torch.get_num_threads()}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    assert out["torch"] == 1 and out["status"]["torch_threads"] == 1
    assert out["status"]["nice_now"] == 7 and "nice_error" not in out["status"]
    assert set(out["threads"]) == {7} and out["later"] == [7]  # threads started later inherit it


def test_apply_http_moves_this_process_and_the_serve_proxies_here_to_http_nice_and_http_cores():
    """The replica's process (the engine steps in another), every process titled as Serve's proxy
    or its HAProxy manager, and every HAProxy: stand-ins here, under names of their own so real
    ones on this machine are left alone."""
    title, manager, binary = "ray::ProxyActorStandIn", "ray::HAProxyManagerStandIn", "/opt/bin/haproxy-stand-in"
    stand_ins = [subprocess.Popen([argv0, "-c", "import time; time.sleep(60)"], executable=sys.executable)
                 for argv0 in (title, manager, binary)]
    proxy, haproxies = stand_ins[0], stand_ins[1:]
    try:
        code = f"""
import json, os
from deployments import core_plan
core_plan.PROXY_TITLE, core_plan.HAPROXY_TITLE, core_plan.HAPROXY_NAME = {title.encode()!r}, {manager.encode()!r}, b"haproxy-stand-in"
status = core_plan.CorePlan.build(num_cpus=2, cores=2, http_nice=9).apply_http()
print(json.dumps({{"status": status, "own": os.getpriority(os.PRIO_PROCESS, 0), "pid": os.getpid()}}))
"""
        out = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
        assert out["own"] == 9 and all(os.getpriority(os.PRIO_PROCESS, p.pid) == 9 for p in stand_ins)
        assert out["status"]["http_nice_now"] == {"replica": 9, f"proxy {proxy.pid}": 9,
                                                  **{f"haproxy {p.pid}": 9 for p in haproxies}}
        assert "http_nice_error" not in out["status"]
        code = code.replace("http_nice=9", "pin_cores=True")
        out = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
        http = sorted(os.sched_getaffinity(0))[1:2]
        assert out["status"]["http_cores_now"] == {"replica": http, f"proxy {proxy.pid}": http,
                                                   **{f"haproxy {p.pid}": http for p in haproxies}}
        assert all(sorted(os.sched_getaffinity(p.pid)) == http for p in stand_ins)
    finally:
        for p in stand_ins:
            p.kill()
            p.wait()
    # null leaves Ray's priority
    assert CorePlan.build(num_cpus=2, cores=2, http_nice=None).apply_http() == {}


def test_pin_cores_binds_the_engine_to_its_threads_cores_and_the_http_stack_to_the_rest():
    plan = AppArgs(num_cpus=2, pin_cores=True).core_plan(cores=2)
    first, second = sorted(os.sched_getaffinity(0))[:2]
    assert plan.engine_cores == (first,) and plan.http_cores == (second,) and "bound to cores" in plan.reason
    threads = plan.step_threads()  # every step on the engine's one core; a background compile on both
    assert [threads.for_batch(b) for b in (1, 16)] == [1, 1] and threads.for_batch(1, prefill=True) == 1
    assert threads.compile_cores == {first, second}
    assert AppArgs(num_cpus=2).core_plan(cores=2).engine_cores is None  # off unless asked


@pytest.mark.parametrize(("args", "named"), [
    ({"large_batch_threads": 2}, "large_batch_threads 2"),
    ({"torch_threads": 2}, "torch_threads 2"),
    ({"engine_process": False}, "engine_process"),
    ({"num_cpus": 1}, "num_cpus >= 2 (got 1)"),
])
def test_pin_cores_where_it_cannot_bind_is_refused_at_start_naming_why(args, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        AppArgs(**{"num_cpus": 2, "pin_cores": True, **args}).core_plan(cores=2)


def test_pinned_apply_binds_the_stepping_thread_and_a_compile_worker_takes_every_core():
    code = """
import json, os, threading
from deployments.core_plan import CorePlan
from lookahead_core.engine.graphs.compile_worker import lowest_priority
plan = CorePlan.build(num_cpus=2, cores=2, pin_cores=True)
status = plan.apply()
later, compile = [], []
own = sorted(os.sched_getaffinity(0))
w = threading.Thread(target=lambda: later.append(sorted(os.sched_getaffinity(0)))); w.start(); w.join()
lowest_priority(plan.step_threads().compile_cores)  # as a compile worker process does, first
compile.append(sorted(os.sched_getaffinity(0)))
print(json.dumps({"status": status, "own": own, "later": later, "compile": compile, "nice": os.nice(0)}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    first, second = sorted(os.sched_getaffinity(0))[:2]
    assert out["own"] == out["later"][0] == out["status"]["engine_cores"] == [first]
    assert out["compile"] == [[first, second]] and out["nice"] == 19


def test_the_http_stack_moved_is_this_ray_nodes_and_this_users_alone():
    """A process titled as Serve's proxy or named haproxy that is not below this replica's raylet
    (here: the applying process's parent, this test), another Ray's or a system HAProxy, or that is
    another user's, keeps its priority and cores."""
    binary = "/opt/bin/haproxy-stand-in"
    ours = subprocess.Popen([binary, "-c", "import time; time.sleep(60)"], executable=sys.executable)
    # another Ray's: started by a process that has exited, so it hangs below init (or a subreaper) instead
    starter = subprocess.run([sys.executable, "-c", f"""
import subprocess, sys
p = subprocess.Popen([{binary!r}, "-c", "import time; time.sleep(60)"], executable=sys.executable,
                     start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(p.pid)
"""], check=True, capture_output=True, text=True)
    foreign = [int(starter.stdout)]
    if os.geteuid() == 0:  # another user's, below this test
        other = subprocess.Popen([binary, "60"], executable="/bin/sleep", user=65534)
        foreign.append(other.pid)
    try:
        code = """
import json
from deployments import core_plan
core_plan.PROXY_TITLE, core_plan.HAPROXY_TITLE = b"ray::ProxyActorStandIn", b"ray::HAProxyManagerStandIn"
core_plan.HAPROXY_NAME = b"haproxy-stand-in"  # the session's own Serve, below this test too, left alone
print(json.dumps(core_plan.CorePlan.build(num_cpus=2, cores=2, http_nice=9).apply_http()))
"""
        before = {pid: os.getpriority(os.PRIO_PROCESS, pid) for pid in foreign}
        out = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
        assert out["http_nice_now"] == {"replica": 9, f"haproxy {ours.pid}": 9}
        assert {pid: os.getpriority(os.PRIO_PROCESS, pid) for pid in foreign} == before
    finally:
        for pid in [ours.pid, *foreign]:
            os.kill(pid, signal.SIGKILL)
        ours.wait()
        if os.geteuid() == 0:
            other.wait()

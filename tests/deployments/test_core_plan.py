"""The replica's core plan: how many torch threads on how many cores, and the priority it takes."""
import json
import os
import subprocess
import sys

from deployments.config import AppArgs
from deployments.core_plan import CorePlan


def test_a_replica_with_every_core_leaves_one_to_the_http_stack():
    assert CorePlan.build(num_cpus=2, cores=2).torch_threads == 1
    assert CorePlan.build(num_cpus=16, cores=16).torch_threads == 15
    assert CorePlan.build(num_cpus=1, cores=1).torch_threads == 1  # nothing to leave


def test_a_replica_with_part_of_the_machine_runs_a_thread_per_core_it_asked_for():
    assert CorePlan.build(num_cpus=4, cores=16).torch_threads == 4
    assert CorePlan.build(num_cpus=0, cores=16).torch_threads == 1
    assert CorePlan.build(num_cpus=0.5, cores=2).torch_threads == 1


def test_torch_threads_in_the_app_args_override_the_rule():
    plan = AppArgs(num_cpus=2, torch_threads=2).core_plan(cores=2)
    assert plan.torch_threads == 2 and "torch_threads" in plan.reason
    assert AppArgs(num_cpus=2).core_plan(cores=2).torch_threads == 1
    assert AppArgs().nice == 0 and AppArgs(nice=None).core_plan(cores=2).nice is None


def test_a_replica_with_every_core_runs_steps_of_many_sequences_on_all_of_them():
    plan = AppArgs(num_cpus=2).core_plan(cores=2)
    threads = plan.step_threads()
    assert plan.torch_threads == 1 and [threads.for_batch(b) for b in (1, 7, 8, 16)] == [1, 1, 2, 2]
    assert AppArgs(num_cpus=2, large_batch_threads=1).core_plan(cores=2).step_threads().for_batch(16) == 1
    assert AppArgs(num_cpus=2, torch_threads=2).core_plan(cores=2).step_threads().for_batch(16) == 2
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


def test_apply_http_moves_this_process_and_the_serve_proxies_here_to_http_nice():
    """The replica's process (the engine steps in another) and every process titled as Serve's proxy:
    a stand-in proxy here, under a title of its own so a real one on this machine is left alone."""
    title = "ray::ProxyActorStandIn"
    proxy = subprocess.Popen([title, "-c", "import time; time.sleep(60)"], executable=sys.executable)
    try:
        code = f"""
import json, os
from deployments import core_plan
core_plan.PROXY_TITLE = {title.encode()!r}
status = core_plan.CorePlan.build(num_cpus=2, cores=2, http_nice=9).apply_http()
print(json.dumps({{"status": status, "own": os.getpriority(os.PRIO_PROCESS, 0), "pid": os.getpid()}}))
"""
        out = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
        assert out["own"] == 9 and os.getpriority(os.PRIO_PROCESS, proxy.pid) == 9
        assert out["status"]["http_nice_now"] == {"replica": 9, f"proxy {proxy.pid}": 9}
        assert "http_nice_error" not in out["status"]
    finally:
        proxy.kill()
        proxy.wait()
    # null leaves Ray's priority
    assert CorePlan.build(num_cpus=2, cores=2, http_nice=None).apply_http() == {}

"""A multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`, as Ray's own tests do):
a head with no CPU for models, and worker nodes that each fit one model replica. The app is
deployed the way `serve deploy` does it, through the head's dashboard."""
from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import requests
import yaml

from deployments.ray_env import free_port, haproxy_ports, prepare
from loadtests.client import prompt_cycle, read_prompts

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "serve_cluster.yaml"
APP = "lookahead"
MODEL_DEPLOYMENT = "LookaheadModel"
LOOPBACK = "127.0.0.1"


def load_config(path: Path = CONFIG, port: int | None = None, autoscaling: dict | None = None,
                num_replicas: int | None = None) -> dict:
    """The cluster config, with the HTTP port and the model deployment's scaling overridden."""
    config = copy.deepcopy(yaml.safe_load(path.read_text()))
    if port is not None:
        config["http_options"]["port"] = port
    for dep in config["applications"][0]["deployments"]:
        if dep["name"] != MODEL_DEPLOYMENT:
            continue
        if num_replicas is not None:
            dep.pop("autoscaling_config", None)
            dep["num_replicas"] = num_replicas
        elif autoscaling is not None:
            dep["autoscaling_config"] = {**dep.get("autoscaling_config", {}), **autoscaling}
    return config


def chat_requests(max_tokens: int):
    """The cluster runs' request bodies: greedy chat prompts, each user cycling through the chat set."""
    return prompt_cycle(read_prompts("chat"), chat=True, max_new_tokens=max_tokens)


def report(result, out: str | None) -> None:
    """Print a run's JSON summary, and write it to `out` when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@dataclass
class LocalCluster:
    """Head plus `workers` nodes of `cpus_per_worker` CPUs; `with LocalCluster(...) as c:`."""

    workers: int = 2
    cpus_per_worker: int = 1
    env: dict = field(default_factory=dict)  # set before the nodes start, so every Ray process sees it

    def __enter__(self) -> Self:
        from ray.cluster_utils import Cluster

        # configs/ray.env and this user's private folder (deployments/ray_env.py); HAProxy's ports of
        # its own, beside another Serve here
        os.environ.update({**prepare(), **haproxy_ports(free_port), **self.env})
        self.dashboard_port = free_port()
        umask = os.umask(0o077)  # the nodes' processes inherit it: their files are this user's alone
        try:
            # every node at 127.0.0.1: Ray's metrics and agents listen on loopback alone (at the host's
            # address, its metrics listen on every interface)
            self.cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1",
                "dashboard_port": self.dashboard_port, "node_ip_address": LOOPBACK})
            self.nodes = [self.cluster.add_node(num_cpus=self.cpus_per_worker, node_ip_address=LOOPBACK)
                          for _ in range(self.workers)]
        finally:
            os.umask(umask)
        self.cluster.wait_for_nodes()
        self.head_node_id = self.cluster.head_node.node_id
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self._wait(lambda: requests.get(self.dashboard + "/api/serve/applications/", timeout=5).ok, 60, "dashboard")
        return self

    def __exit__(self, *exc) -> None:
        try:
            requests.delete(self.dashboard + "/api/serve/applications/", timeout=30)
        except requests.RequestException:
            pass
        self.cluster.shutdown()

    def deploy(self, config: dict, timeout_s: float = 240) -> str:
        """PUT the config as `serve deploy` does; returns the HTTP base URL once the app is RUNNING."""
        r = requests.put(self.dashboard + "/api/serve/applications/", json=config, timeout=30)
        if not r.ok:
            raise RuntimeError(f"serve deploy: HTTP {r.status_code} from the dashboard: {r.text[-2000:]}")
        self._wait(lambda: self.app().get("status") == "RUNNING", timeout_s, "the app to be RUNNING")
        url = f"http://127.0.0.1:{config['http_options']['port']}"
        self._wait(lambda: requests.get(url + "/health", timeout=5).ok, 60, "/health")
        return url

    def app(self) -> dict:
        details = requests.get(self.dashboard + "/api/serve/applications/", timeout=10).json()
        return details.get("applications", {}).get(APP, {})

    def replicas(self) -> list[dict]:
        """The model deployment's replicas: state, node_id, actor_id, pid."""
        dep = self.app().get("deployments", {}).get(MODEL_DEPLOYMENT, {})
        return dep.get("replicas", [])

    def running_replicas(self) -> list[dict]:
        return [r for r in self.replicas() if r.get("state") == "RUNNING"]

    def node_of(self, node_id: str):
        """The cluster_utils node object whose raylet has this id."""
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(node_id)

    def remove_node(self, node, pids: tuple[int, ...] = (), timeout_s: float = 60) -> None:
        """Kill the node; return once its processes in `pids` (its replicas) have exited too: a worker
        outlives its killed raylet for a moment and may still stream."""
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)
        self._wait(lambda: not any(_alive(pid) for pid in pids), timeout_s, f"processes {list(pids)} to exit")

    @staticmethod
    def _wait(check, timeout_s: float, what: str) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                if check():
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")

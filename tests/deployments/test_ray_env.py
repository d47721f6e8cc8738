"""configs/ray.env and deployments/ray_env.py: the environment every Ray of this project starts with,
read in one place; the private folder for Ray's and HAProxy's files; HAProxy's launcher."""
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.local_cluster import free_port
from deployments.ray_env import (
    RAY_ENV_FILE,
    _real_haproxy,
    haproxy_ports,
    held_ports,
    listeners,
    prepare,
    private_config,
    ray_env,
    runtime_dir,
    runtime_env,
    serve_ports,
)
from tests.fixtures import wait_until


def test_the_shipped_environment_turns_on_serves_haproxy_ingress_and_off_usage_stats():
    env = ray_env()
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert all(not key.startswith("#") for key in env)  # comments are not variables
    assert RAY_ENV_FILE.parent.name == "configs"


def test_a_line_that_is_not_key_value_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "ray.env"
    path.write_text("# fine\nA=1\n\nexport B=2\n")
    with pytest.raises(ValueError, match=r"ray.env:4: expected KEY=VALUE, got 'export B=2'"):
        ray_env(path)
    path.write_text(" A = 1 \nC=x=y\n")
    assert ray_env(path) == {"A": "1", "C": "x=y"}


def test_haproxy_gets_stats_and_metrics_ports_of_its_own():
    ports = iter([41001, 41002])
    assert haproxy_ports(lambda: next(ports)) == {"RAY_SERVE_HAPROXY_STATS_PORT": "41001",
                                                  "RAY_SERVE_HAPROXY_METRICS_PORT": "41002"}


def test_the_runtime_folder_is_made_private_and_one_made_by_another_user_or_open_to_others_is_refused(tmp_path):
    folder = runtime_dir(tmp_path)
    st = folder.stat()
    assert folder.name == f"lookahead-{os.getuid()}" and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert runtime_dir(tmp_path) == folder  # found again as it is
    folder.chmod(0o755)
    with pytest.raises(RuntimeError, match="drwxr-xr-x: other users may enter it"):
        runtime_dir(tmp_path)
    folder.rmdir()
    folder.symlink_to(tmp_path)  # a name taken first, pointing elsewhere
    with pytest.raises(RuntimeError, match="another user made it first"):
        runtime_dir(tmp_path)
    if os.geteuid() == 0:
        folder.unlink()
        folder.mkdir(mode=0o700)
        os.chown(folder, 65534, 65534)
        with pytest.raises(RuntimeError, match="uid 65534's.*another user made it first"):
            runtime_dir(tmp_path)
    with pytest.raises(ValueError, match="97 bytes"):
        runtime_env(tmp_path / ("x" * 40), {})


def test_every_ray_and_haproxy_path_of_the_shipped_environment_is_in_the_private_folder():
    """Serve 2.60's defaults: /tmp/haproxy-serve (any user may make it first; an admin socket of
    mode 666 in it), /tmp/ray (Ray makes its session folders 0777)."""
    env = prepare({})
    folder = runtime_dir()
    paths = {k: v for k, v in env.items() if k == "RAY_TMPDIR" or k.startswith("RAY_SERVE_HAPROXY_")
             and k.endswith(("_PATH", "_LOC", "_BASE", "_FILE"))}
    assert len(paths) == 7 and all(Path(v).is_relative_to(folder) for v in paths.values()), paths
    launcher = Path(env["RAY_SERVE_HAPROXY_BINARY_PATH"])
    assert stat.S_IMODE(launcher.stat().st_mode) == 0o700 and launcher.read_text().startswith("#!/bin/sh\n")
    assert prepare({"RAY_SERVE_HAPROXY_BINARY_PATH": str(launcher)}) == env  # a launcher is not wrapped again
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # Ray at 127.0.0.1: its metrics on loopback


def _serve_template_config(folder: Path, host: str = "0.0.0.0") -> Path:
    """The config Serve 2.60's own template renders (HAProxyManager's, before any backend)."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(http_options=HTTPOptions(host=host, port=free_port()), socket_path=f"{folder}/admin.sock",
                        server_state_base=str(folder), server_state_file=f"{folder}/server-state",
                        metrics_socket_path=f"{folder}/metrics.sock", stats_port=free_port(), metrics_port=free_port())
    api = HAProxyApi(cfg, config_file_path=f"{folder}/haproxy.cfg")
    api._generate_config_file_internal()
    return Path(api.config_file_path)


def test_haproxys_stats_and_metrics_bind_to_loopback_and_its_defaults_get_a_request_timeout(tmp_path):
    """Serve's template binds `listen stats` to `*` and the Prometheus frontend to every interface,
    and sets no `timeout http-request`; the HTTP frontend keeps the host it was given."""
    text = _serve_template_config(tmp_path).read_text()
    binds = [line.split()[1] for line in text.splitlines() if line.strip().startswith("bind ")]
    assert [b.rpartition(":")[0] for b in binds] == ["", "*", "*"] and "timeout http-request" not in text
    private = private_config(text, "127.0.0.1", 10)
    assert [line.split()[1] for line in private.splitlines() if line.strip().startswith("bind ")] == [
        f"127.0.0.1:{binds[0].rpartition(':')[2]}", binds[1], f"127.0.0.1:{binds[2].rpartition(':')[2]}"]
    assert "defaults\n    timeout http-request 10s\n" in private and private_config(private, "127.0.0.1", 10) == private
    (tmp_path / "private.cfg").write_text(private)
    check = subprocess.run([_real_haproxy("", tmp_path), "-c", "-f", str(tmp_path / "private.cfg")], capture_output=True)
    assert check.returncode == 0, check.stderr.decode()[-2000:]


def test_haproxy_started_through_the_launcher_ends_with_the_process_that_started_it(tmp_path):
    """Serve's manager actor starts HAProxy as a plain child; a stop by process group ends the
    raylet, the raylet's end the manager (no shutdown runs), and HAProxy went on holding the ports.
    Here a stand-in manager in a session of its own starts HAProxy as Serve does, and is killed."""
    config = _serve_template_config(tmp_path, host="127.0.0.1")
    env = prepare({})
    manager = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
p = subprocess.Popen([{env["RAY_SERVE_HAPROXY_BINARY_PATH"]!r}, "-db", "-f", {str(config)!r}, "-dR"])
print(p.pid, flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True, start_new_session=True)
    haproxy = int(manager.stdout.readline())
    text = config.read_text()
    ports = {int(line.split()[1].rpartition(":")[2]) for line in text.splitlines() if line.strip().startswith("bind ")}
    try:
        assert wait_until(lambda: ports <= {s.port for s in listeners()}, 10), "HAProxy did not listen"
        assert {(s.address, s.port) for s in listeners() if s.port in ports} == {("127.0.0.1", p) for p in ports}
    finally:
        os.kill(manager.pid, signal.SIGKILL)  # the manager alone (HAProxy is in its group) ends, no shutdown run
        manager.wait()
    assert wait_until(lambda: not ports & {s.port for s in listeners()}, 10), "HAProxy outlived its manager, on its ports"
    assert wait_until(lambda: not os.path.exists(f"/proc/{haproxy}") or _zombie(haproxy), 10), "HAProxy outlived its manager"


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(") ", 1)[1][0] == "Z"


def test_a_port_the_server_needs_that_is_taken_is_named_with_what_holds_it(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        (held,) = held_ports({"HTTP": port, "HAProxy stats": free_port()}, "127.0.0.1")
        assert held.startswith(f"HTTP port {port} is held by pid {os.getpid()} (uid {os.getuid()}): ") and "python" in held
        config = tmp_path / "serve.yaml"
        config.write_text(f"http_options: {{host: 127.0.0.1, port: {port}}}\n")
        assert serve_ports(config, {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_STATS_PORT": "1"}) == (
            "127.0.0.1", {"HTTP": port, "HAProxy stats": 1, "HAProxy metrics": 9101})
        out = subprocess.run([sys.executable, str(RAY_ENV_FILE.parents[1] / "deployments" / "ray_env.py"), "env", str(config)],
                             capture_output=True, text=True)
    assert out.returncode == 1 and out.stdout == "" and f"HTTP port {port} is held by pid {os.getpid()}" in out.stderr
    out = subprocess.run([sys.executable, str(RAY_ENV_FILE.parents[1] / "deployments" / "ray_env.py"), "env", str(config)],
                         capture_output=True, text=True, env={**os.environ, "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
                                                              "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port())})
    assert out.returncode == 0 and "export RAY_TMPDIR=" in out.stdout, out.stderr


def test_a_free_port_is_below_the_kernels_ephemeral_range_and_binds():
    import socket

    from deployments.ray_env import FREE_PORTS, free_port
    port = free_port()
    assert FREE_PORTS[0] <= port < FREE_PORTS[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        only = held.getsockname()[1]
        with pytest.raises(RuntimeError, match="no free port"):
            free_port((only, only + 1))

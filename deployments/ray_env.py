"""The environment every Ray this project starts runs with: configs/ray.env, one KEY=VALUE a line."""
from __future__ import annotations

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

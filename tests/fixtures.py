"""Paths and helpers shared by test modules (import them from here, not from another test module)."""
import time
from collections.abc import Callable
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "benchmarks" / "prompts"


def wait_until(check: Callable[[], object], timeout_s: float, interval: float = 0.02) -> bool:
    """Poll `check` until it is true (a server not answering yet counts as false); False on timeout."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if check():
                return True
        except requests.RequestException:
            pass
        time.sleep(interval)
    return False


def fresh_health(url: str, **kwargs) -> dict:
    """/health once its figures are newer than the last read (the engine's status is read at most
    every STATUS_MAX_AGE_S, whoever asks)."""
    from lookahead_core.engine.host.async_engine import STATUS_MAX_AGE_S

    time.sleep(STATUS_MAX_AGE_S + 0.1)
    return requests.get(url + "/health", timeout=30, **kwargs).json()

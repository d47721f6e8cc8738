"""Load shapes for campaigns: step ramp, spike, soak. Parameters come from environment variables
set by the campaign runner (LOOKAHEAD_SHAPE_*), so one locustfile serves every shape."""
from __future__ import annotations

import os

from locust import LoadTestShape


def _env(name: str, default: float) -> float:
    return float(os.environ.get(f"LOOKAHEAD_SHAPE_{name}", default))


class StepRamp(LoadTestShape):
    """users: STEP, 2*STEP, ... up to MAX, each held for STEP_S seconds."""

    def tick(self):
        step, top, hold = int(_env("STEP", 2)), int(_env("MAX", 16)), _env("STEP_S", 30)
        k = int(self.get_run_time() // hold) + 1
        users = k * step
        return None if users > top else (users, float(step))


class Spike(LoadTestShape):
    """BASE users, a SPIKE of users for SPIKE_S seconds after WARM_S, then BASE again until END_S."""

    def tick(self):
        t = self.get_run_time()
        base, spike = int(_env("BASE", 2)), int(_env("SPIKE", 24))
        warm, spike_s, end = _env("WARM_S", 20), _env("SPIKE_S", 20), _env("END_S", 60)
        if t > end:
            return None
        return (spike, float(spike)) if warm <= t < warm + spike_s else (base, float(spike))


class Soak(LoadTestShape):
    """USERS users for DURATION_S seconds."""

    def tick(self):
        return None if self.get_run_time() > _env("DURATION_S", 1200) else (int(_env("USERS", 8)), 4.0)


SHAPES = {"step": StepRamp, "spike": Spike, "soak": Soak}

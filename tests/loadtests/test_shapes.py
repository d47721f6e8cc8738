"""Load shapes: users over time, from the parameters the campaign sets in the environment.

Locust monkey-patches the standard library with gevent on import, so the shapes are evaluated in
a subprocess, never in the test process.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
from loadtests.shapes import SHAPES
out = {}
for name, times in json.loads(sys.argv[1]).items():
    shape = SHAPES[name]()
    ticks = []
    for t in times:
        shape.get_run_time = lambda t=t: t
        ticks.append(shape.tick())
    out[name] = ticks
print(json.dumps(out))
"""


def ticks(times: dict, **env) -> dict:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **{f"LOOKAHEAD_SHAPE_{k}": str(v) for k, v in env.items()}}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(times)], capture_output=True, text=True, env=environ, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_step_ramp_climbs_then_stops():
    got = ticks({"step": [0, 9.9, 10, 25, 30]}, STEP=4, MAX=12, STEP_S=10)["step"]
    assert got == [[4, 4.0], [4, 4.0], [8, 4.0], [12, 4.0], None]


def test_spike_rises_and_falls():
    got = ticks({"spike": [0, 9, 10, 14, 15, 29, 31]}, BASE=2, SPIKE=20, WARM_S=10, SPIKE_S=5, END_S=30)["spike"]
    assert [g[0] if g else None for g in got] == [2, 2, 20, 20, 2, 2, None]


def test_soak_holds_then_ends():
    assert ticks({"soak": [100, 1201]}, USERS=6, DURATION_S=1200)["soak"] == [[6, 4.0], None]

import pytest
from pydantic import ValidationError

from lookahead_core.policy.cost_profile import Setting, StepCostProfile

from .test_controller import cpu_like_profile


def test_profile_interpolates_and_extrapolates():
    p = cpu_like_profile()
    assert p.step_ms(1, 1) == pytest.approx(2.05)
    assert p.step_ms(3, 10) == pytest.approx(2 + 0.05 * 3 * 10, rel=0.1)
    assert p.step_ms(64, 1) > p.step_ms(32, 1)


def test_profile_validation_and_round_trip(tmp_path):
    p = cpu_like_profile()
    path = tmp_path / "p.yaml"
    p.save(path)
    assert StepCostProfile.load(path) == p
    with pytest.raises(ValidationError, match="plain"):
        StepCostProfile(**{**p.model_dump(), "settings": [Setting(n=4, w=5, g=5)]})
    with pytest.raises(ValidationError, match="rows"):
        StepCostProfile(**{**p.model_dump(), "latency_ms": [[1.0]]})


def test_noisy_cells_are_lowered_to_the_cheapest_bigger_step():
    """A measured grid where batch 2 came out slower than batch 4 (interference during timing)."""
    p = StepCostProfile(
        model="noisy", device="cpu", batch_sizes=[1, 2, 4], tokens=[1, 8, 16],
        latency_ms=[[4.0, 6.5, 7.5], [8.6, 16.4, 13.9], [6.0, 11.1, 16.3]],
        settings=[Setting(n=None)],
    )
    assert p.step_ms(2, 1) == pytest.approx(6.0)
    assert p.step_ms(2, 8) == pytest.approx(11.1)
    assert p.step_ms(2, 16) == pytest.approx(13.9)
    assert p.step_ms(1, 1) == pytest.approx(4.0)  # cells already below every bigger step stay
    assert p.latency_ms[1][0] == 8.6  # the measurement itself is kept as written
    grid = [[p.step_ms(b, t) for t in p.tokens] for b in p.batch_sizes]
    assert all(row == sorted(row) for row in grid)
    assert all(list(col) == sorted(col) for col in zip(*grid))


def test_a_profile_warns_when_the_engine_runs_another_shared_pool():
    p = StepCostProfile(**{**cpu_like_profile().model_dump(), "shared_pool_cap": 8})
    assert p.pool_mismatch(8) is None and p.pool_mismatch(4) is None
    assert "--shared-pool-cap 0" in p.pool_mismatch(0)
    assert cpu_like_profile().pool_mismatch(0) is None and "shared_pool_cap=0" in cpu_like_profile().pool_mismatch(8)

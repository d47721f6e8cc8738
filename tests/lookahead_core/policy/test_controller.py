import pytest
from pydantic import ValidationError

from lookahead_core import LookaheadParams
from lookahead_core.engine.step_costs import StepCosts
from lookahead_core.policy.controller import LookaheadPolicy, PolicyConfig
from lookahead_core.policy.cost_profile import Setting, StepCostProfile


def cpu_like_profile() -> StepCostProfile:
    """Step cost 2 ms + 0.05 ms per token in the batch: compute-bound like a CPU."""
    bs, ts = [1, 2, 4, 8, 16, 32], [1, 4, 8, 16, 32, 64]
    return StepCostProfile(
        model="synthetic", device="cpu", batch_sizes=bs, tokens=ts,
        latency_ms=[[2 + 0.05 * b * t for t in ts] for b in bs],
        settings=[
            Setting(n=None, compression=1.0, step_tokens=1),
            Setting(n=4, w=5, g=5, compression=2.2, step_tokens=20),
            Setting(n=3, w=2, g=2, compression=1.5, step_tokens=6),
        ],
    )


def gpu_like_profile() -> StepCostProfile:
    """Flat cost up to 512 tokens in the batch: memory-bound, extra tokens are free."""
    bs, ts = [1, 32], [1, 64]
    return StepCostProfile(
        model="synthetic", device="cuda", batch_sizes=bs, tokens=ts, latency_ms=[[10, 10.1], [10.2, 11]],
        settings=[Setting(n=None), Setting(n=4, w=5, g=5, compression=2.2, step_tokens=20)],
    )


def router(policy="goodput", profile=None, **kw):
    cfg = PolicyConfig(policy=policy, profile="unused.yaml" if policy == "goodput" else None, min_dwell_steps=0, **kw)
    return LookaheadPolicy(cfg, profile=profile or cpu_like_profile())


def test_goodput_uses_lookahead_when_idle_and_plain_when_busy():
    r = router()
    assert r.choose(1) == LookaheadParams(4, 5, 5)
    r2 = router()
    assert r2.choose(16) is None
    assert r2.goodput(r2.profile.settings[0], 16) > r2.goodput(r2.profile.settings[1], 16)


def test_goodput_keeps_lookahead_where_extra_tokens_are_free():
    r = router(profile=gpu_like_profile())
    assert r.choose(32) == LookaheadParams(4, 5, 5)


def test_unmeetable_slo_falls_back_to_best_goodput():
    # at depth 1 the fastest per-token setting is (4,5,5) at ~1.4 ms/token: 0.5 ms is out of reach
    assert router(slo={"tpot_ms": 0.5}).choose(1) == LookaheadParams(4, 5, 5)


def test_slo_breach_switches_at_once_despite_dwell():
    cfg = PolicyConfig(policy="goodput", profile="x.yaml", min_dwell_steps=100, slo={"tpot_ms": 5.0})
    r = LookaheadPolicy(cfg, profile=cpu_like_profile())
    assert r.choose(1) == LookaheadParams(4, 5, 5)
    # at depth 16, (4,5,5) costs ~12 ms per token, plain ~2.8 ms
    assert r.tpot_ms(r.profile.settings[1], 16) > 5.0 > r.tpot_ms(r.profile.settings[0], 16)
    assert r.choose(16) is None


def test_hysteresis_and_dwell_prevent_flapping():
    cfg = PolicyConfig(policy="goodput", profile="x.yaml", min_dwell_steps=5, hysteresis=0.1)
    r = LookaheadPolicy(cfg, profile=cpu_like_profile())
    first = r.choose(1)
    seen = [r.choose(d) for d in [16, 1, 16, 1]]
    assert all(s == first for s in seen)  # dwell not reached
    for _ in range(5):
        last = r.choose(16)
    assert last is None and r.switches == 1


def test_fixed_plain_and_table_policies():
    assert router("plain").choose(1) is None
    assert router("fixed", fixed={"n": 3, "w": 4, "g": 4}).choose(99) == LookaheadParams(3, 4, 4)
    t = router("queue_depth_table", table=[{"max_depth": 2, "lookahead": {"n": 5, "w": 7, "g": 7}},
                                           {"max_depth": 8, "lookahead": {"n": 3, "w": 2, "g": 2}},
                                           {"max_depth": 10**9}])
    assert [t.choose(d) for d in (1, 5, 50)] == [LookaheadParams(5, 7, 7), LookaheadParams(3, 2, 2), None]


def test_measured_step_costs_replace_the_profile_and_the_choice_follows_them():
    costs = StepCosts(alpha=0.2)
    r = LookaheadPolicy(PolicyConfig(profile="x.yaml", min_dwell_steps=0), profile=cpu_like_profile(), costs=costs)
    assert r.choose(1) == LookaheadParams(4, 5, 5)
    choices = []
    for step in range(60):  # the machine drifts: wide steps grow from the profile's 3 ms to 8 ms
        wide = 3.0 + 5.0 * min(step / 30, 1.0)
        costs.observe(1, 1, 2.05)
        costs.observe(1, 20, wide)
        costs.observe(1, 6, 2.3 + (wide - 3.0) * 0.4)
        choices.append(r.choose(1))
    assert choices[0] == LookaheadParams(4, 5, 5)
    assert choices[-1] is None  # 2.2 tokens for 8 ms loses to 1 token for 2 ms
    assert r.step_ms(r.profile.settings[1], 1) == pytest.approx(costs.measured(1, 20))


def test_unmeasured_cells_follow_the_drift_of_measured_ones():
    costs = StepCosts()
    r = LookaheadPolicy(PolicyConfig(profile="x.yaml", slo={"tpot_ms": 3.0}), profile=cpu_like_profile(), costs=costs)
    plain = r.profile.settings[0]
    assert r._meets_slo(plain, 4)
    for _ in range(200):
        costs.observe(8, 1, 2 * r.profile.step_ms(8, 1))  # everything now runs at half speed
        r.choose(1)
    assert r.cost_scale == pytest.approx(2.0, rel=0.01)
    assert r.step_ms(plain, 4) == pytest.approx(2 * r.profile.step_ms(4, 1), rel=0.01)
    assert not r._meets_slo(plain, 4)


def test_observed_acceptance_replaces_the_profiled_compression():
    r = router(learn_after_steps=8)
    assert r.choose(1) == LookaheadParams(4, 5, 5)
    r.observe(LookaheadParams(4, 5, 5), steps=4, tokens=4, rows=80)
    assert r.choose(1) == LookaheadParams(4, 5, 5)  # too few steps to go by
    r.observe(LookaheadParams(4, 5, 5), steps=40, tokens=42, rows=800)
    assert r.learned(r.profile.settings[1]) == pytest.approx((1.05, 20.0), rel=0.1)
    assert r.choose(1) == LookaheadParams(3, 2, 2)
    r.observe(LookaheadParams(3, 2, 2), steps=40, tokens=40, rows=40 * 9)
    assert r.choose(1) is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"policy": "fixed"}, "needs `fixed"),
        ({"policy": "queue_depth_table"}, "needs `table"),
        ({"policy": "goodput"}, "needs `profile"),
        ({"policy": "queue_depth_table", "table": [{"max_depth": 5}, {"max_depth": 2}]}, "increasing"),
        ({"policy": "fixed", "fixed": {"n": 3}}, "all of n, w, g"),
        ({"policy": "fixed", "fixed": {"n": 1, "w": 2, "g": 2}}, "n must be >= 2"),
        ({"policy": "nope"}, "Input should be"),
    ],
)
def test_config_errors(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        PolicyConfig(**kwargs)

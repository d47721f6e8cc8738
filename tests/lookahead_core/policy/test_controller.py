import pytest
from pydantic import ValidationError

from lookahead_core import LookaheadParams
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

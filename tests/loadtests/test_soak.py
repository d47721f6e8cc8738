"""The soak script's memory verdict (the run itself takes 20 minutes: a documented run, not a test)."""
import pytest

from loadtests.soak import rss_growth


def test_growth_is_measured_from_the_end_of_the_warmup_per_replica():
    samples = [{"t": t, "pid": 7, "rss_mb": mb} for t, mb in [(0, 400.0), (30, 600.0), (60, 610.0), (600, 640.0), (1200, 671.0)]]
    samples += [{"t": 900, "pid": 9, "rss_mb": 500.0}, {"t": 905, "pid": None, "rss_mb": None}]
    g = rss_growth(samples, warmup_s=60)
    assert g[7]["warm"] == 610.0 and g[7]["last"] == 671.0 and g[7]["peak"] == 671.0
    assert g[7]["growth"] == pytest.approx(0.1)
    # A replica seen for less than the warm-up is measured from its first sample.
    assert g[9]["warm"] is None and g[9]["growth"] == 0.0
    assert set(g) == {7, 9}

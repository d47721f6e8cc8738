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


def test_the_prober_counts_health_answers_by_status():
    import http.server
    import threading
    import time

    from loadtests.soak import Prober

    answers = iter([200, 200, 503])

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(next(answers, 200))
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prober = Prober(f"http://127.0.0.1:{server.server_address[1]}", 0.01)
    prober.start()
    try:
        deadline = time.time() + 10
        while sum(prober.statuses.values()) < 5 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        prober.halt.set()
        prober.join()
        server.shutdown()
    assert prober.statuses["503"] == 1 and prober.statuses["200"] >= 4 and prober.slowest_ms > 0


def test_the_off_tpot_is_read_from_the_summarys_kinds():
    from loadtests.soak import off_tpot_p95

    assert off_tpot_p95({"by_kind": {"off": {"tpot": {"p50": 30.0, "p95": 41.5}}}}) == 41.5
    assert off_tpot_p95({"by_kind": {"auto": {}}}) is None and off_tpot_p95({}) is None

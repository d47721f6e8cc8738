"""Fuzz the HTTP API from its own OpenAPI schema: >= 1,000 generated requests, no 5xx, no restart."""
from collections import Counter

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

EXAMPLES = 180  # per POST operation and generation mode: 3 x 2 x 180 = 1,080 requests


def test_generated_requests_never_get_a_5xx_nor_restart_the_replica(server):
    schema = schemathesis.openapi.from_url(server + "/openapi.json")
    before = requests.get(server + "/health", timeout=10).json()["replica"]
    statuses: Counter = Counter()
    failures = []

    for result in schema.get_all_operations():
        op = result.ok()
        # Operations without a body or parameters have no invalid variants to generate.
        modes = list(schemathesis.GenerationMode) if op.method.upper() == "POST" else [schemathesis.GenerationMode.POSITIVE]
        for mode in modes:
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            # op is bound while run() runs, in this iteration; the qualname also seeds derandomize's examples
            def run(case):
                r = case.call(base_url=server, timeout=60)
                statuses[(op.label, r.status_code)] += 1  # noqa: B023
                if r.status_code >= 500:
                    failures.append((case.as_curl_command(), r.status_code, r.text[:300]))

            run()

    total = sum(statuses.values())
    print(f"{total} requests:", dict(sorted(statuses.items())))
    assert not failures, failures[:5]
    assert total >= 1000
    # Valid and invalid requests were both exercised.
    assert sum(n for (label, code), n in statuses.items() if label.startswith("POST") and code == 200) >= 25
    # malformed bodies: 422 on /generate, 400 on the OpenAI routes
    assert sum(n for (label, code), n in statuses.items() if code in (400, 422)) >= 100
    after = requests.get(server + "/health", timeout=10).json()
    assert after["status"] == "ok" and after["replica"]["pid"] == before["pid"]
    assert after["replica"]["started_at"] == before["started_at"]  # no replica restart
    assert after["running"] == 0

"""Fuzz the HTTP API from its own OpenAPI schema: >= 1,000 generated requests, no 5xx, no restart,
and a body valid by the schema is one the server serves."""
from collections import Counter

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

EXAMPLES = 180  # per POST operation and generation mode: 3 x 2 x 180 = 1,080 requests
# The schema carries the server's limits (deployments/bounded_bodies.py); what it cannot say is a prompt's
# length in tokens (over max_prompt_tokens, or with its budget past max_seq_len): 22-29 of 540 here. Nor
# can it say a grammar's syntax, nor min_tokens above the request's own token budget (given, or the
# default): those 400s are counted apart, each naming its field.
SERVED_SHARE = 0.9
UNSTATED = {"min_tokens=": '"param":"min_tokens"', "does not parse": '{"error":{"message":"`'}
UNSTATED_SHARE = 0.25


def served(case, response) -> bool:
    """Served as asked: a 200, or a 408 for a request whose own timeout_s ran out."""
    own_timeout = isinstance(case.body, dict) and case.body.get("timeout_s") is not None
    return response.status_code == 200 or (response.status_code == 408 and own_timeout)


def test_generated_requests_never_get_a_5xx_nor_restart_the_replica(server):
    schema = schemathesis.openapi.from_url(server + "/openapi.json")
    before = requests.get(server + "/health", timeout=10).json()["replica"]
    statuses: Counter = Counter()
    refused: Counter = Counter()  # schema-valid POST bodies not served: (route, status, message)
    valid_posts = 0
    failures = []

    for result in schema.get_all_operations():
        op = result.ok()
        post = op.method.upper() == "POST"
        # Operations without a body or parameters have no invalid variants to generate.
        modes = list(schemathesis.GenerationMode) if post else [schemathesis.GenerationMode.POSITIVE]
        for mode in modes:
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            # op and mode are bound while run() runs, in this iteration; the qualname also seeds derandomize's examples
            def run(case):
                nonlocal valid_posts
                r = case.call(base_url=server, timeout=60)
                statuses[(op.label, r.status_code)] += 1  # noqa: B023
                if r.status_code >= 500:
                    failures.append((case.as_curl_command(), r.status_code, r.text[:300]))
                if post and mode == schemathesis.GenerationMode.POSITIVE:  # noqa: B023
                    valid_posts += 1
                    if not served(case, r):
                        refused[(op.label, r.status_code, r.text[:160])] += 1  # noqa: B023

            run()

    total = sum(statuses.values())
    print(f"{total} requests:", dict(sorted(statuses.items())))
    print(f"{valid_posts} schema-valid POSTs, {sum(refused.values())} refused:", refused.most_common(10))
    assert not failures, failures[:5]
    assert total >= 1000
    assert valid_posts >= 3 * EXAMPLES * 0.9
    unstated = {k: n for k, n in refused.items() if k[1] == 400 and any(u in k[2] for u in UNSTATED)}
    assert all(named in k[2] for k in unstated for u, named in UNSTATED.items() if u in k[2]), list(unstated)[:3]
    assert sum(unstated.values()) <= UNSTATED_SHARE * valid_posts, list(unstated.items())[:5]
    assert sum(refused.values()) - sum(unstated.values()) <= (1 - SERVED_SHARE) * valid_posts, refused.most_common(10)
    assert sum(n for (label, code), n in statuses.items() if label.startswith("POST") and code == 200) >= 25
    # malformed bodies: 422 on /generate, 400 on the OpenAI routes
    assert sum(n for (label, code), n in statuses.items() if code in (400, 422)) >= 100
    after = requests.get(server + "/health", timeout=10).json()
    assert after["status"] == "ok" and after["replica"]["pid"] == before["pid"]
    assert after["replica"]["started_at"] == before["started_at"]  # no replica restart
    assert after["running"] == 0

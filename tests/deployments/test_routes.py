"""Where the routes run: on the model replica (the default, one hop) or in the separate ingress
(the cluster configs, which resend a request whose replica was lost). Both serve the same routes."""
import pytest
import requests

from lookahead_core.serving import sse
from tests.deployments.test_http_api import expected, local  # noqa: F401  (a fixture)
from tests.fixtures import wait_until


@pytest.fixture(scope="module")
def behind_ingress(server, tiny_model_dir):
    from ray import serve

    from deployments.app import build_app

    args = {"model": {"path": str(tiny_model_dir), "name": "tiny", "dtype": "float32"},
            "engine": {"max_batch": 2, "max_seq_len": 256, "max_new_tokens": 32, "prefill_chunk": 32},
            "auth": {"api_keys": ["k" * 20]}, "http_routes": "ingress", "num_cpus": 0}
    serve.run(build_app(args), name="behind-ingress", route_prefix="/behind-ingress")
    url = server + "/behind-ingress"
    wait_until(lambda: requests.get(url + "/health", timeout=5).status_code == 200, 60, interval=0.5)
    yield url
    serve.delete("behind-ingress")


def deployments_of(app: str) -> set[str]:
    from ray import serve

    return set(serve.status().applications[app].deployments)


def test_the_default_app_is_the_model_replica_alone(server):
    assert deployments_of("lookahead") == {"LookaheadModel"}


def test_the_separate_ingress_serves_the_same_routes(behind_ingress, local):  # noqa: F811
    assert deployments_of("behind-ingress") == {"LookaheadModel", "LookaheadAPI"}
    auth = {"Authorization": "Bearer " + "k" * 20}
    assert requests.get(behind_ingress + "/health", timeout=10).json() == {"status": "ok"}  # open: the status alone
    health = requests.get(behind_ingress + "/health", headers=auth, timeout=10).json()  # through the handle
    assert health["status"] == "ok" and health["model"] == "tiny"
    body = {"prompt": "import os", "max_new_tokens": 12, "lookahead": "off"}
    assert requests.post(behind_ingress + "/generate", json=body, timeout=60).status_code == 401
    r = requests.post(behind_ingress + "/generate", json=body, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["token_ids"] == expected(local, "import os", 12)
    r = requests.post(behind_ingress + "/generate", json={**body, "stream": True}, headers=auth, stream=True, timeout=60)
    *chunks, done = sse.events(r.iter_lines())
    assert done == sse.DONE and chunks[-1]["token_ids"] == expected(local, "import os", 12)
    # a refusal is the envelope naming its field, as on the replica's own routes
    r = requests.post(behind_ingress + "/v1/completions", json={"model": "other", "prompt": "a"}, headers=auth, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"

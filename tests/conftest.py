"""Shared fixtures: a real Ray Serve application on CPU with a tiny saved model (one per session)."""
import os

import pytest
import requests
import torch

from deployments.ray_env import free_port, haproxy_ports, prepare
from lookahead_core.models.random_models import build_random_model
from tests.fixtures import wait_until
from tests.lookahead_core.helpers import char_tokenizer

# Ray reads its environment where it starts, and Serve its flags where it is imported: before either.
# With it, this user's private folder for Ray's sessions and HAProxy's files (deployments/ray_env.py).
for key, value in prepare().items():
    os.environ.setdefault(key, value)

DRAIN = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"

# A small chat template for the tiny model (whose tokenizer has none): the server config sets it.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-serve-model")
    model = build_random_model("llama", vocab_size=128)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    """Base URL of a running app; torn down (Serve and Ray) at the end of the session."""
    import ray
    from ray import serve

    from deployments.app import build_app

    os.environ.update(haproxy_ports(free_port))  # beside a `make serve` or a cluster test's Serve
    # A replica that stops stays reachable this long for load balancers to drop it (Serve's default:
    # 30 s); here every app a test deletes would wait it out. Set for this Ray only: the cluster
    # tests' Ray, started later, drains as shipped.
    os.environ[DRAIN] = "1"
    umask = os.umask(0o077)  # Ray's processes inherit it: their files are this user's alone
    try:
        # at 127.0.0.1 Ray's metrics and agents listen on loopback alone (on every interface at the host's address)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 _node_ip_address="127.0.0.1")
    finally:
        os.umask(umask)
        del os.environ[DRAIN]
    # Ray's own processes take ephemeral ports too: pick one after ray.init and retry on a clash.
    for attempt in range(5):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            break
        except Exception:
            serve.shutdown()
            if attempt == 4:
                raise
    args = {
        "model": {"path": str(tiny_model_dir), "name": "tiny", "dtype": "float32", "chat_template": TINY_CHAT_TEMPLATE},
        "engine": {"max_batch": 4, "max_seq_len": 256, "max_new_tokens": 64, "prefill_chunk": 32,
                   "lookahead": {"n": 3, "w": 3, "g": 3},
                   # the graphs compile in the background, as the shipped config's
                   "compile": "auto", "compile_max_width": 8},
        "num_cpus": 0,
    }
    serve.run(build_app(args), name="lookahead", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=5).status_code == 200, 60, interval=0.5)
    yield url
    serve.shutdown()
    ray.shutdown()

torch.set_num_threads(2)


# Test tiers (markers registered in pyproject.toml): `make test-fast` runs `-m "not serve and not cluster
# and not slow and not compile"`, `make test` runs everything. A module states its own tier with `pytestmark`
# (`compile` sits on the few tests that compile); `serve` is set here, per test, on every test that uses the
# session's `server` fixture, since a module may mix such tests with ones that start no Ray.
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "server" in item.fixturenames:
            item.add_marker(pytest.mark.serve)

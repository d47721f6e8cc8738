"""configs/ray.env: the environment every Ray of this project starts with, read in one place."""
import pytest

from deployments.ray_env import RAY_ENV_FILE, haproxy_ports, ray_env


def test_the_shipped_environment_turns_on_serves_haproxy_ingress_and_off_usage_stats():
    env = ray_env()
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert all(not key.startswith("#") for key in env)  # comments are not variables
    assert RAY_ENV_FILE.parent.name == "configs"


def test_a_line_that_is_not_key_value_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "ray.env"
    path.write_text("# fine\nA=1\n\nexport B=2\n")
    with pytest.raises(ValueError, match=r"ray.env:4: expected KEY=VALUE, got 'export B=2'"):
        ray_env(path)
    path.write_text(" A = 1 \nC=x=y\n")
    assert ray_env(path) == {"A": "1", "C": "x=y"}


def test_haproxy_gets_stats_and_metrics_ports_of_its_own():
    ports = iter([41001, 41002])
    assert haproxy_ports(lambda: next(ports)) == {"RAY_SERVE_HAPROXY_STATS_PORT": "41001",
                                                  "RAY_SERVE_HAPROXY_METRICS_PORT": "41002"}

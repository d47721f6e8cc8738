"""The black-box script's own parts (the run itself serves the shipped model: a documented run)."""
import yaml

from deployments.config import AppArgs
from loadtests.blackbox import ROOT, keyed_config


def test_the_shipped_config_is_served_with_keys_read_from_the_named_variable():
    config = yaml.safe_load(keyed_config(ROOT / "serve_config.yaml", "SOME_KEYS").read_text())
    shipped = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    (app,) = config["applications"]
    assert app["args"]["auth"] == {"api_keys_env": "SOME_KEYS"}
    assert AppArgs.model_validate(app["args"]).auth.resolve_keys({"SOME_KEYS": "k" * 20}) == ["k" * 20]
    del app["args"]["auth"]
    assert config == shipped  # nothing else changed

"""Fixtures of the load-test modules that drive the session's real Serve app."""
import json

import pytest


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """A prompt set of four short code prompts, so each request is quick on the tiny model."""
    path = tmp_path_factory.mktemp("prompts") / "short.jsonl"
    texts = ["def f(x):", "import os", "class A:", "x = [1, 2"]
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(texts)))
    return path

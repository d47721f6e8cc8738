"""The runner's idle turn: once the forwards since the last one are done, the heap pages they
freed go back to the OS, once, and never while a graph still has calls to time."""
import torch

from lookahead_core.engine.runner import model_runner
from lookahead_core.engine.runner.model_runner import ModelRunner
from lookahead_core.models.random_models import build_random_model


def test_an_idle_turn_after_forwards_returns_freed_memory_once(monkeypatch):
    trims = []
    monkeypatch.setattr(model_runner, "release_freed_memory", lambda: trims.append(1))
    runner = ModelRunner(build_random_model("llama", vocab_size=128))
    runner.allocate(2, 32, 4)
    trims.clear()  # laying the weights out trimmed once
    assert runner.idle_turn() is False and trims == []  # no forward since
    cache = runner.cache
    cache.prepare_slot(0, 0, 3)
    with torch.inference_mode():
        runner.prefill(torch.tensor([[5, 6, 7]]), 0, cache)
    assert runner.idle_turn() is False and trims == [1]
    assert runner.idle_turn() is False and trims == [1]  # no forward since: no second trim

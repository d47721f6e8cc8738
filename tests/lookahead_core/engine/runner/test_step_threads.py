"""Torch threads per forward by its batch (a prompt chunk: a large batch's): the runner switches them per
step, eager or compiled."""
import torch

from lookahead_core.engine.runner.kv_cache import BatchKVCache
from lookahead_core.engine.runner.model_runner import ModelRunner
from lookahead_core.engine.runner.step_threads import StepThreads
from lookahead_core.models.random_models import build_random_model


def test_the_threads_follow_the_batch():
    threads = StepThreads(1, large_batch=8, large_threads=2)
    assert [threads.for_batch(b) for b in (1, 7, 8, 16)] == [1, 1, 2, 2]
    assert StepThreads(3).for_batch(64) == 3
    assert threads.for_batch(1, prefill=True) == 2 and StepThreads(3).for_batch(1, prefill=True) == 3


def test_the_runner_runs_each_forward_on_its_batchs_threads():
    model = build_random_model("llama", vocab_size=64)
    runner = ModelRunner(model, threads=StepThreads(1, large_batch=2, large_threads=2))
    cache = BatchKVCache(model.config.num_hidden_layers, max_batch=2, capacity=16)
    before = torch.get_num_threads()
    seen = []
    try:
        with torch.inference_mode():
            for rows in (1, 2, 1):
                cache.prepare_rows(rows, torch.zeros((rows, 1), dtype=torch.long), 1)
                runner.decode(torch.ones((rows, 1), dtype=torch.long), torch.zeros((rows, 1), dtype=torch.long),
                              torch.zeros((rows, 1, 1, 1)), cache)
                seen.append(torch.get_num_threads())
            cache.prepare_slot(0, 0, 2)
            runner.prefill(torch.ones((1, 2), dtype=torch.long), 0, cache, torch.zeros((1, 1, 2, 2)))
            seen.append(torch.get_num_threads())
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2, 1, 2]  # a prompt chunk runs on the large batch's threads

import pytest
import torch

from lookahead_core import SlotKVCache


def _kv(t, fill):
    return torch.full((1, 2, t, 4), float(fill))


def test_update_writes_at_length_and_returns_the_filled_view():
    cache = SlotKVCache(num_layers=2, capacity=16)
    k, v = cache.update(_kv(3, 1), _kv(3, -1), layer_idx=0)
    assert k.shape[2] == 3 and v.shape[2] == 3
    cache.length = 3
    k, _ = cache.update(_kv(2, 2), _kv(2, -2), layer_idx=0)
    assert k.shape[2] == 5
    assert k[0, 0, :, 0].tolist() == [1, 1, 1, 2, 2]
    assert cache.get_seq_length() == 3
    assert cache.get_mask_sizes(2, 0) == (5, 0)


def test_commit_moves_the_accepted_candidate_behind_the_last_token():
    cache = SlotKVCache(num_layers=1, capacity=16)
    cache.length = 4
    step = torch.arange(8, dtype=torch.float32).view(1, 1, 8, 1).expand(1, 2, 8, 4).contiguous()
    cache.update(step, -step, layer_idx=0)
    # step rows: 0 = last token, 5..6 = accepted candidate prefix
    cache.commit(step_start=4, kept=3, moved_from=4 + 5, moved=2)
    assert cache.length == 7
    keys = cache.layers[0].keys[0, 0, 4:7, 0].tolist()
    values = cache.layers[0].values[0, 0, 4:7, 0].tolist()
    assert keys == [0, 5, 6] and values == [0, -5, -6]


def test_commit_without_a_candidate_keeps_one_token():
    cache = SlotKVCache(num_layers=1, capacity=8)
    cache.update(_kv(3, 1), _kv(3, 1), layer_idx=0)
    cache.commit(step_start=0, kept=1)
    assert cache.length == 1


def test_overlapping_move_is_refused():
    cache = SlotKVCache(num_layers=1, capacity=8)
    cache.update(_kv(4, 1), _kv(4, 1), layer_idx=0)
    with pytest.raises(ValueError):
        cache.commit(step_start=0, kept=3, moved_from=2, moved=2)


def test_overflow_is_an_error_not_a_silent_truncation():
    cache = SlotKVCache(num_layers=1, capacity=4)
    with pytest.raises(RuntimeError, match="overflow"):
        cache.update(_kv(5, 1), _kv(5, 1), layer_idx=0)


def test_storage_is_allocated_once():
    cache = SlotKVCache(num_layers=1, capacity=8)
    cache.update(_kv(2, 1), _kv(2, 1), layer_idx=0)
    ptr = cache.layers[0].keys.data_ptr()
    cache.length = 2
    cache.update(_kv(3, 1), _kv(3, 1), layer_idx=0)
    assert cache.layers[0].keys.data_ptr() == ptr

import torch

from lookahead_core.engine.runner.kv_cache import BatchKVCache


def _kv(rows, t, fill):
    return torch.full((rows, 2, t, 4), float(fill))


def test_rows_write_at_their_own_offsets_and_read_one_view():
    cache = BatchKVCache(num_layers=1, max_batch=4, capacity=16)
    idx = torch.tensor([[3, 4], [7, 8]])
    cache.prepare_rows(2, idx, kv_len=9)
    step = torch.stack([_kv(1, 2, 1)[0], _kv(1, 2, 2)[0]])
    k, v = cache.update(step, -step, layer_idx=0)
    assert k.shape == (2, 2, 9, 4)
    keys = cache.layers[0].keys
    assert keys[0, 0, 3:5, 0].tolist() == [1, 1] and keys[1, 0, 7:9, 0].tolist() == [2, 2]
    assert keys[0, 0, 7, 0] == 0  # nothing written outside each row's offsets


def test_slot_write_and_compaction():
    cache = BatchKVCache(num_layers=2, max_batch=2, capacity=16)
    cache.prepare_slot(1, start=2, tokens=3)
    data = torch.arange(3, dtype=torch.float32).view(1, 1, 3, 1).expand(1, 2, 3, 4).contiguous()
    for layer in range(2):
        cache.update(data, data, layer_idx=layer)
    assert cache.layers[0].keys[1, 0, 2:5, 0].tolist() == [0, 1, 2]
    cache.compact(torch.tensor([1]), src=torch.tensor([4]), dst=torch.tensor([3]))
    assert cache.layers[1].values[1, 0, 2:5, 0].tolist() == [0, 2, 2]


def test_move_slot_fills_a_hole():
    cache = BatchKVCache(num_layers=1, max_batch=3, capacity=8)
    cache.prepare_slot(2, 0, 3)
    cache.update(_kv(1, 3, 5), _kv(1, 3, 5), layer_idx=0)
    cache.lengths[2] = 3
    cache.move_slot(2, 0)
    assert cache.lengths[0] == 3 and cache.lengths[2] == 0
    assert cache.layers[0].keys[0, 0, :3, 0].tolist() == [5, 5, 5]


def test_move_tokens_moves_a_contiguous_run_of_one_slot():
    cache = BatchKVCache(num_layers=1, max_batch=2, capacity=16)
    cache.prepare_slot(1, 4, 8)
    step = torch.arange(8, dtype=torch.float32).view(1, 1, 8, 1).expand(1, 2, 8, 4).contiguous()
    cache.update(step, -step, layer_idx=0)
    cache.move_tokens(1, src=4 + 5, dst=4 + 1, count=2)  # the accepted candidate's rows behind the last token
    layer = cache.layers[0]
    assert layer.keys[1, 0, 4:7, 0].tolist() == [0, 5, 6] and layer.values[1, 0, 4:7, 0].tolist() == [0, -5, -6]
    assert layer.keys[0].abs().sum() == 0  # other slots untouched
    cache.move_tokens(1, src=5, dst=4, count=3)  # overlapping ranges move as a block
    assert layer.keys[1, 0, 4:7, 0].tolist() == [5, 6, 3]


def test_move_entries_of_one_slot_or_several_land_in_the_same_place():
    step = torch.arange(8, dtype=torch.float32).view(1, 1, 8, 1).expand(2, 2, 8, 4).contiguous()
    results = []
    for slots, src, dst in (([1, 1], [9, 10], [5, 6]), ([0, 1, 1], [9, 9, 10], [5, 5, 6])):
        cache = BatchKVCache(num_layers=1, max_batch=2, capacity=16)
        cache.lengths[:] = [4, 4]
        cache.prepare_rows(2, torch.tensor([[4 + i for i in range(8)]] * 2), kv_len=12)
        cache.update(step, -step, layer_idx=0)
        cache.move_entries(slots, src, dst)
        results.append(cache.layers[0].keys[1, 0, 4:7, 0].tolist())
    assert results == [[0, 5, 6], [0, 5, 6]]


def test_one_row_writes_contiguously_at_its_length():
    cache = BatchKVCache(num_layers=1, max_batch=2, capacity=16)
    cache.lengths[0] = 5
    cache.prepare_rows(1, torch.tensor([[5, 6, 7]]), kv_len=8)
    assert cache.write_start == 5 and cache.rows == (0, 1) and cache.kv_len == 8
    k, _ = cache.update(_kv(1, 3, 2), _kv(1, 3, -2), layer_idx=0)
    assert k.shape[2] == 8 and k[0, 0, 5:8, 0].tolist() == [2, 2, 2]

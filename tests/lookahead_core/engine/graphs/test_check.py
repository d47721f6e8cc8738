import torch

from lookahead_core.engine.graphs.check import logits_differ


def test_a_graph_is_checked_per_position_and_bf16_may_miss_one_position_in_four():
    want = torch.randn(2, 4, 50, generator=torch.Generator().manual_seed(0)) * 10
    one_off = want.clone()
    one_off[1, 1] += 8.0  # a position of outsized activations, rounded otherwise by a fused graph
    assert logits_differ(want.clone(), want, torch.float32) is None
    assert "at 1 of 8 positions" in logits_differ(one_off, want, torch.float32)
    assert logits_differ(one_off, want, torch.bfloat16) is None
    three_off = one_off.clone()
    three_off[0, :2] -= 8.0
    assert "at 3 of 8 positions" in logits_differ(three_off, want, torch.bfloat16)
    garbage = torch.randn(2, 4, 50, generator=torch.Generator().manual_seed(1)) * 10
    assert logits_differ(garbage, want, torch.bfloat16) is not None

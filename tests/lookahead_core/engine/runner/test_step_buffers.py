import torch

from lookahead_core.engine.runner.step_buffers import BatchStepBuffers

MIN = torch.finfo(torch.float32).min


def test_mask_blocks_keep_the_invariant():
    buf = BatchStepBuffers(max_batch=2, max_tokens=4, capacity=12, dtype=torch.float32, device=torch.device("cpu"))
    buf.reset_slot(0, 3)
    tpl = torch.tensor([[0.0, MIN], [0.0, 0.0]])
    buf.write_block(0, 3, tpl, width=4)
    m = buf.mask[0, 0]
    assert (m[:, :3] == 0).all()
    assert m[:2, 3:5].tolist() == tpl.tolist()
    assert m[2, 5] == 0 and m[3, 6] == 0 and m[2, 6] == MIN  # padding rows see only themselves
    assert (m[:, 7:] == MIN).all()
    # next step: 2 tokens committed, one-token block
    buf.write_block(0, 5, torch.zeros(1, 1), width=1)
    assert (m[:, :5] == 0).all() and m[0, 5] == 0
    assert (m[0, 6:] == MIN).all() and (m[1:, 5:] == MIN).all()


def test_reset_slot():
    buf = BatchStepBuffers(max_batch=1, max_tokens=2, capacity=6, dtype=torch.float32, device=torch.device("cpu"))
    buf.write_block(0, 0, torch.zeros(2, 2), width=2)
    buf.reset_slot(0, 2)
    m = buf.mask[0, 0]
    assert (m[:, :2] == 0).all() and (m[:, 2:] == MIN).all()

"""A step exports over every size it serves, in each dtype the engine serves, with grouped-query
attention (the served model's): the exported program computes the eager step at widths and
batches other than those it was traced at. Export only, no inductor compile."""
import pytest
import torch

from lookahead_core.engine.graphs.buckets import Bucket
from lookahead_core.engine.graphs.compile_worker import export_step
from lookahead_core.engine.graphs.staging import DynamicStaging
from lookahead_core.engine.graphs.step import StepModule, decode_step, prefill_step
from lookahead_core.engine.runner.weights import apply_layout
from lookahead_core.models.random_models import build_random_model

CAP = 64


@pytest.mark.parametrize("dtype,layout", [(torch.float32, "transposed"), (torch.bfloat16, "plain"),
                                          (torch.bfloat16, "onednn")])  # packed: fused projections traced
@pytest.mark.parametrize("prefill", [False, True])
def test_a_grouped_query_step_exports_and_runs_at_other_sizes(dtype, layout, prefill):
    if layout == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    model = build_random_model("llama", vocab_size=256, heads=4, kv_heads=2, dtype=dtype)
    apply_layout(model, layout)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = [torch.zeros(4, cfg.num_key_value_heads, CAP, head_dim, dtype=dtype) for _ in range(2 * cfg.num_hidden_layers)]
    bucket = Bucket(1 if prefill else 4, 16 if prefill else 8, CAP - 1, prefill=prefill)
    staging = DynamicStaging(bucket, kv, CAP - 1, dtype, torch.device("cpu"))
    step = StepModule(model, prefill_step if prefill else decode_step)
    program = export_step(step, staging).module()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for batch, width in [(1, 1), (1 if prefill else 3, 3), (1, bucket.width)]:
        staging.probe(batch, width, cfg.vocab_size)
        inputs = staging.inputs()
        with torch.inference_mode():
            got = program(*inputs[:5], inputs[5:])[0]
            want = step(*inputs[:5], inputs[5:])[0]
        assert got.shape == want.shape == (batch, 1 if prefill else width, cfg.vocab_size)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)

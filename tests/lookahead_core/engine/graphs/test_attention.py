"""Grouped-query attention as traced graphs take it: only on the thread that traces, and equal to
transformers' own attention."""
import threading
from types import SimpleNamespace

import pytest
import torch

from lookahead_core.engine.graphs.attention import install_sdpa_gqa, packed_gqa_attention, tracing

MIN = torch.finfo(torch.float32).min


def test_the_graph_form_acts_only_on_the_thread_that_traces():
    from transformers.integrations import sdpa_attention

    install_sdpa_gqa()
    key, mask = torch.zeros(1, 3, 4, 8), torch.zeros(1, 1, 1, 4)
    seen, inside, leave = [], threading.Event(), threading.Event()

    def trace():
        with tracing():
            seen.append(sdpa_attention.use_gqa_in_sdpa(mask, key, key))
            inside.set()
            leave.wait(10)

    other = threading.Thread(target=trace)
    other.start()
    try:
        assert inside.wait(10) and seen == [True]
        assert sdpa_attention.use_gqa_in_sdpa(mask, key, key) is False  # this thread's eager forward
    finally:
        leave.set()
        other.join()


@pytest.mark.parametrize("width", [1, 5])
def test_packed_grouped_query_attention_is_transformers_attention(width):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(width)
    q, k, v = (torch.randn(shape, generator=gen).to(torch.bfloat16)
               for shape in ((2, 4, width, 16), (2, 2, 9, 16), (2, 2, 9, 16)))
    mask = torch.zeros(2, 1, width, 9)
    mask[:, 0, :, 9 - width :] = torch.full((width, width), MIN).triu_(1)
    mask[1, 0, :, :3] = MIN  # keys another row does not see
    mask = mask.to(torch.bfloat16)
    ref, _ = sdpa_attention_forward(SimpleNamespace(num_key_value_groups=2, is_causal=True), q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(packed_gqa_attention(q, k, v, mask, 2, 0.25).float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_a_traced_bf16_forward_packs_grouped_query_heads(monkeypatch):
    """While tracing, a bf16 forward's grouped-query attention runs packed in every layer, with
    eager's logits; outside a trace it keeps transformers' attention."""
    from lookahead_core.engine.graphs import attention
    from lookahead_core.models.random_models import build_random_model

    install_sdpa_gqa()
    bf16 = build_random_model("llama", vocab_size=64, dtype=torch.bfloat16)
    calls = []
    packed = attention.packed_gqa_attention
    monkeypatch.setattr(attention, "packed_gqa_attention", lambda *args: calls.append(1) or packed(*args))
    ids = torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.full((2, 1, 12, 12), MIN).triu_(1).to(torch.bfloat16)

    def forward():
        return bf16(input_ids=ids, attention_mask=mask, position_ids=torch.arange(12)[None].expand(2, 12)).logits

    with torch.inference_mode():
        eager = forward()
        assert not calls
        with tracing():
            traced = forward()
    assert len(calls) == bf16.config.num_hidden_layers
    torch.testing.assert_close(traced.float(), eager.float(), rtol=2e-2, atol=2e-2)

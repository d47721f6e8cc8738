"""Fused projections compute what the model's own did: the same logits and greedy tokens, with and
without a cache, for each architecture fused or left alone; the classes fused have Llama's forward."""
import inspect

import pytest
import torch
from torch import nn

from lookahead_core.engine.runner.fused_projections import ATTENTION, GATED_MLP, fuse_projections
from lookahead_core.engine.runner.weights import PackedLinear, apply_layout
from lookahead_core.models.random_models import build_random_model

# modules fused per layer: attention and MLP (Llama, Gemma), the MLP alone (Mistral, Qwen2), none (Phi-3, GPT-2)
FUSED_PER_LAYER = {"llama": 2, "gemma": 2, "mistral": 1, "qwen2": 1, "phi3": 0, "gpt2": 0}


def _ids(vocab: int = 128) -> torch.Tensor:
    return torch.randint(2, vocab, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", sorted(FUSED_PER_LAYER))
def test_fused_models_give_the_models_logits_and_greedy_tokens(arch):
    plain = build_random_model(arch, vocab_size=128)
    model = build_random_model(arch, vocab_size=128)
    layers = plain.config.num_hidden_layers
    assert fuse_projections(model) == FUSED_PER_LAYER[arch] * layers
    ids = _ids()
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        # generate() runs every step through a cache: the fused forward's cache.update
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, **kw), plain.generate(ids, **kw))
    if FUSED_PER_LAYER[arch] == 2:
        attn = model.model.layers[0].self_attn
        assert not hasattr(attn, "q_proj") and attn.qkv_proj.out_features == sum(attn.qkv_sizes)


def test_packed_fused_layers_give_the_packed_unfused_logits_in_bfloat16():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    unfused = build_random_model("llama", vocab_size=128, dtype=torch.bfloat16)
    model = build_random_model("llama", vocab_size=128, dtype=torch.bfloat16)
    for parent in list(unfused.modules()):  # packed as before fusion: one PackedLinear per projection
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
    info = apply_layout(model, "onednn")
    assert info.linear_layers == 2 * 4 + 1
    ids = _ids()
    with torch.inference_mode():
        fused_logits, logits = model(input_ids=ids).logits, unfused(input_ids=ids).logits
    torch.testing.assert_close(fused_logits, logits, rtol=0, atol=2e-2)
    assert torch.equal(fused_logits.argmax(-1), logits.argmax(-1))


def test_an_uninitialised_model_is_fused_without_copying():
    model = build_random_model("llama", vocab_size=128)
    fuse_projections(model, copy=False)
    mlp = model.model.layers[0].mlp
    assert mlp.gate_up_proj.weight.shape == (2 * mlp.down_proj.in_features, mlp.down_proj.out_features)


def test_the_classes_fused_compute_as_llamas_forward_does():
    """A transformers release that changes one of these forwards must fail here, not serve wrong text."""
    import transformers

    def forward_source(name: str) -> str:
        module = name.removesuffix("Attention").removesuffix("MLP").lower()
        cls = getattr(getattr(transformers.models, module), f"modeling_{module}").__dict__[name]
        return inspect.getsource(cls.forward).replace(name, "X")

    for names in (ATTENTION, GATED_MLP):
        assert {forward_source(n) for n in names} == {forward_source(names[0])}

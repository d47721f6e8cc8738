"""The one copy of the weights: each layout gives the plain model's logits, lays a tied weight out
once for all that hold it, and leaves nothing of the loaded copy resident."""
import pytest
import torch

from lookahead_core.engine.runner.weights import PackedLinear, apply_layout, resolve_layout, weight_bytes
from lookahead_core.models.random_models import build_random_model, tiny_config


def _logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("layout", ["transposed", "onednn", "plain"])
def test_every_layout_gives_the_plain_models_logits(layout):
    plain = build_random_model("llama", vocab_size=128)
    model = build_random_model("llama", vocab_size=128)
    ids = torch.randint(2, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    info = apply_layout(model, layout)
    # on CPU each layer's query-key-value and gate-up projections are one layer each
    assert info.layout == layout and info.linear_layers == 2 * (7 if layout == "plain" else 4) + 1
    torch.testing.assert_close(_logits(model, ids), _logits(plain, ids), rtol=1e-4, atol=1e-4)
    if layout == "onednn":
        assert sum(isinstance(m, PackedLinear) for m in model.modules()) == info.linear_layers
    if layout == "transposed":
        w = model.model.layers[0].mlp.gate_up_proj.weight
        assert w.stride() == (1, w.shape[0])  # stored [in, out]: the GEMM reads contiguous rows


def test_a_tied_weight_is_laid_out_once_for_the_embedding_and_the_head():
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", vocab_size=128)
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    plain_bytes = weight_bytes(model)
    apply_layout(model, "transposed")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert weight_bytes(model) == plain_bytes  # one copy, as loaded
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)
    assert apply_layout(model, "transposed").bytes == plain_bytes  # laid out again: nothing changes


def test_the_loaded_copy_is_released(tmp_path):
    """A checkpoint loaded from a mapped file: once laid out, no tensor keeps the mapping (and its
    pages) alive beside the new copy."""
    from transformers import AutoModelForCausalLM

    build_random_model("llama", vocab_size=128).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    name = str(tmp_path / "model.safetensors")

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return any(name in line for line in f)

    assert mapped()
    apply_layout(model, "transposed")
    import gc

    gc.collect()
    assert not mapped()


def test_auto_picks_by_device_and_dtype_and_a_wrong_layout_is_refused():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_layout("auto", cpu, torch.float32) == "transposed"
    assert resolve_layout("auto", cpu, torch.bfloat16) == "onednn"
    assert resolve_layout("auto", cuda, torch.float16) == "plain"
    with pytest.raises(ValueError, match="is for CPU"):
        resolve_layout("onednn", cuda, torch.float16)
    with pytest.raises(ValueError, match="choose from auto"):
        resolve_layout("packed", cpu, torch.float32)  # type: ignore[arg-type]

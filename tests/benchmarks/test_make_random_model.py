"""make_random_model writes a folder both servers load: the published config's architecture with
random weights at the init's scale, tied as published, and the default model's tokenizer. A
shrunken copy of the 1.7B config stands for it here (its weights would take 3.4 GB)."""
import json

import pytest
import torch

from benchmarks import make_random_model

pytestmark = pytest.mark.slow  # the default model's tokenizer comes from its GGUF


def test_the_folder_loads_with_the_published_architecture_and_the_default_tokenizer(tmp_path, monkeypatch):
    from lookahead_core.models.loading import load_model

    small = {**make_random_model.CONFIGS["SmolLM2-1.7B"], "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}
    monkeypatch.setitem(make_random_model.CONFIGS, "SmolLM2-1.7B", small)
    out = make_random_model.main(["--out", str(tmp_path / "model"), "--seed", "3"])
    assert json.loads((out / "random_weights.json").read_text()) == {"config_of": "SmolLM2-1.7B", "seed": 3,
                                                                     "dtype": "torch.bfloat16"}
    model, tokenizer = load_model(str(out), dtype="bfloat16")
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.vocab_size) == ("llama", 2, 49152)
    assert cfg.rope_parameters["rope_theta"] == 130000
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as published
    w = model.model.layers[0].mlp.up_proj.weight.float()
    assert 0.015 < w.std().item() < 0.025 and w.mean().abs().item() < 0.002  # the init's scale, not a constant
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokenizer.encode("Hello there")])).logits
    assert torch.isfinite(logits).all() and logits.float().std() > 0

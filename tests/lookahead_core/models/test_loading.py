"""lookahead_core.models.loading: GGUF files (written here, in-process), the dequantized cache, and path/dtype resolution.

The GGUF is a tiny random Llama written with the `gguf` package the way llama.cpp's
convert_hf_to_gguf.py writes one (F32 tensors, q/k rows permuted, a byte-level BPE vocabulary), so the
whole round trip -- transformers' GGUF loader, our rebuild-and-cache step, and the later loads from the
cache -- is checked against the source model's own logits.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from lookahead_core.models.loading import dequantized_gguf, load_model, native_bf16, resolve_dtype, resolve_model_path

gguf = pytest.importorskip("gguf")

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 64, 2, 4, 2, 128, 256
HEAD_DIM = HIDDEN // HEADS
ROPE_THETA = 10000.0
RMS_EPS = 1e-5
TEXT = "hello world"

# Byte-level BPE vocabulary: two control tokens, the 256 byte symbols, then the merges' results.
SPECIALS = ["<|bos|>", "<|eos|>"]
BYTE_SYMBOLS = [bytes_to_unicode()[b] for b in range(256)]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "r l", "Ġwo rl", "Ġworl d"]
TOKENS = SPECIALS + BYTE_SYMBOLS + [m.replace(" ", "") for m in MERGES]
BOS_ID, EOS_ID = 0, 1
VOCAB = len(TOKENS)  # 267
TOKEN_CONTROL, TOKEN_NORMAL = 3, 1  # llama.cpp's TokenType values

# The input ids the logits are compared on: every special, some bytes, the merged words, a repeat.
IDS = [BOS_ID, TOKENS.index("hello"), TOKENS.index("Ġworld"), 40, 41, 200, TOKENS.index("hello"), VOCAB - 1, EOS_ID]


def random_llama(seed: int) -> LlamaForCausalLM:
    """A random tiny Llama; every tensor (norms included) random, so a misplaced one shows in the logits."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=RMS_EPS,
        rope_theta=ROPE_THETA,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0, 0.3)
    return model


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF's rotate-half rows -> llama.cpp's interleaved rows)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for a LlamaForCausalLM parameter."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    leaves = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    parts = hf_name.split(".")
    assert parts[:2] == ["model", "layers"] and parts[-1] == "weight", hf_name
    leaf = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{leaves[leaf]}.weight"


def write_llama_gguf(model: LlamaForCausalLM, path: Path, name: str = "tiny-llama") -> Path:
    """Write `model` as an F32 GGUF, the way llama.cpp's converter lays out a Llama."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")  # the constructor writes general.architecture
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([TOKEN_CONTROL] * len(SPECIALS) + [TOKEN_NORMAL] * (VOCAB - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)

    state = model.state_dict()
    for hf_name, tensor in state.items():
        weights = tensor.detach().float().numpy().copy()
        if ".self_attn.q_proj." in hf_name:
            weights = llama_cpp_permute(weights, config.num_attention_heads, config.num_attention_heads)
        elif ".self_attn.k_proj." in hf_name:
            weights = llama_cpp_permute(weights, config.num_attention_heads, config.num_key_value_heads)
        writer.add_tensor(gguf_name(hf_name), np.ascontiguousarray(weights, dtype=np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def source():
    return random_llama(seed=0)


@pytest.fixture(scope="module")
def gguf_path(source, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gguf-model")
    return write_llama_gguf(source, folder / "tiny-llama-f32.gguf")


def cache_entries(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.iterdir()) if cache_dir.exists() else []


def test_permute_inverse_of_transformers_reverse():
    """Our writer's permutation is undone exactly by transformers' GGUF reader (q: heads, k: kv heads)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    rng = np.random.default_rng(0)
    q = rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    k = rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    back_q = processor.process(llama_cpp_permute(q, HEADS, HEADS), "blk.0.attn_q.weight").weights
    back_k = processor.process(llama_cpp_permute(k, HEADS, KV_HEADS), "blk.0.attn_k.weight").weights
    np.testing.assert_array_equal(back_q, q)
    np.testing.assert_array_equal(back_k, k)
    assert not np.array_equal(llama_cpp_permute(q, HEADS, HEADS), q)  # the permutation is not the identity


def test_gguf_file_loads_and_matches_source(source, gguf_path, tmp_path):
    cache_dir = tmp_path / "cache"
    model, tokenizer = load_model(str(gguf_path), dtype="float32", cache_dir=cache_dir)

    assert next(model.parameters()).dtype == torch.float32
    assert not model.training
    torch.testing.assert_close(logits(model), logits(source), rtol=1e-5, atol=1e-5)

    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert ids == [TOKENS.index("hello"), TOKENS.index("Ġworld")]
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.eos_token == SPECIALS[EOS_ID]

    entries = cache_entries(cache_dir)
    assert len(entries) == 1, entries  # one cache folder, no staging leftovers
    target = entries[0]
    assert target.name.startswith(f"{gguf_path.stem}-") and len(target.name) == len(gguf_path.stem) + 1 + 16
    assert (target / "config.json").is_file()
    assert (target / "model.safetensors").is_file()
    assert "quantization_config" not in (target / "config.json").read_text()


def test_folder_and_gguf_file_form_then_cache_hit(source, gguf_path, tmp_path, caplog):
    cache_dir = tmp_path / "cache"
    folder, name = str(gguf_path.parent), gguf_path.name
    caplog.set_level(logging.INFO, logger="lookahead_core.models.loading")

    start = time.perf_counter()
    first, tok1 = load_model(folder, gguf_file=name, dtype="float32", cache_dir=cache_dir)
    first_s = time.perf_counter() - start
    assert any("dequantizing" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(logits(first), logits(source), rtol=1e-5, atol=1e-5)

    [target] = cache_entries(cache_dir)
    weights = target / "model.safetensors"
    stamp = weights.stat().st_mtime_ns

    caplog.clear()
    assert dequantized_gguf(folder, name, cache_dir) == target  # a cache hit: the same folder, nothing rewritten
    # Loads from the cache skip the GGUF parse and the safetensors write. They take milliseconds here,
    # so keep the best of three: one preempted run on a busy machine must not fail the test.
    second_s = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        second, tok2 = load_model(folder, gguf_file=name, dtype="float32", cache_dir=cache_dir)
        second_s = min(second_s, time.perf_counter() - start)

    assert not any("dequantizing" in r.getMessage() for r in caplog.records)
    assert cache_entries(cache_dir) == [target]
    assert weights.stat().st_mtime_ns == stamp
    assert second_s < first_s, (first_s, second_s)
    torch.testing.assert_close(logits(second), logits(first), rtol=0, atol=0)
    assert tok2.encode(TEXT, add_special_tokens=False) == tok1.encode(TEXT, add_special_tokens=False)


def test_changed_gguf_gets_its_own_cache_entry(gguf_path, tmp_path):
    """The cache is keyed by content: another model under the same file name is not served the old weights."""
    cache_dir = tmp_path / "cache"
    first, _ = load_model(str(gguf_path), dtype="float32", cache_dir=cache_dir)

    other = random_llama(seed=1)
    other_path = write_llama_gguf(other, tmp_path / gguf_path.name)  # same name, other folder and weights
    second, _ = load_model(str(other_path), dtype="float32", cache_dir=cache_dir)

    assert len(cache_entries(cache_dir)) == 2
    torch.testing.assert_close(logits(second), logits(other), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits(second), logits(first))


def test_chat_template_replaces_tokenizer_template(gguf_path, tmp_path):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    _, tokenizer = load_model(str(gguf_path), dtype="float32", cache_dir=tmp_path / "cache", chat_template=template)
    assert tokenizer.chat_template == template
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<user>hi"


def test_resolve_model_path_gguf_forms(gguf_path):
    assert resolve_model_path(str(gguf_path)) == (str(gguf_path.parent), gguf_path.name)
    assert resolve_model_path(str(gguf_path.parent), gguf_path.name) == (str(gguf_path.parent), gguf_path.name)
    assert resolve_model_path("some-org/some-model") == ("some-org/some-model", None)


def test_resolve_model_path_package_form():
    import lookahead_core

    package_dir = Path(lookahead_core.__file__).parent
    folder, gguf_file = resolve_model_path("package:lookahead_core/some/folder")
    assert (Path(folder), gguf_file) == (package_dir / "some" / "folder", None)


def test_resolve_model_path_errors(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match="nope.gguf"):
        resolve_model_path(str(missing))
    with pytest.raises(ValueError, match="no_such_pkg"):
        resolve_model_path("package:no_such_pkg/x.gguf")
    with pytest.raises(ValueError, match="absent.gguf"):
        resolve_model_path(str(tmp_path), gguf_file="absent.gguf")
    with pytest.raises(ValueError, match="absent.gguf"):
        load_model(str(tmp_path), gguf_file="absent.gguf", dtype="float32", cache_dir=tmp_path / "cache")


def test_resolve_model_path_missing_dotted_package():
    with pytest.raises(ValueError, match="no_such_pkg"):
        resolve_model_path("package:no_such_pkg.sub/x.gguf")


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native_bf16("cpu") else torch.float32)
    assert resolve_dtype("float32") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype("float16") == torch.float16
    with pytest.raises(ValueError, match="float8"):
        resolve_dtype("float8")
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model("random:tiny", dtype="float64")

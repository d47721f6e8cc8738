"""The demo CLI and the benchmark run end to end on a saved tiny model, offline."""
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from benchmarks import bench_decode
from lookahead_core import demo
from lookahead_core.tiny_models import build_random_model


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = build_random_model("llama", vocab_size=128)
    model.save_pretrained(path)
    vocab = {chr(i): i for i in range(32, 127)}
    vocab.update({"<unk>": 0, "</s>": 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    return path


def test_demo_prints_completion_speed_and_identity(saved_model, capsys):
    code = demo.main(["--model", str(saved_model), "--prompt", "def add(a, b):", "--max-new-tokens", "16", "--n", "3", "--w", "3", "--g", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("def add(a, b):")
    assert "compression" in out and "speedup vs plain" in out and "outputs identical: True" in out


def test_demo_rejects_bad_params(saved_model, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--model", str(saved_model), "--prompt", "x", "--n", "1"])
    assert exc.value.code == 2
    assert "n must be >= 2" in capsys.readouterr().err


def test_bench_decode_reports_peers_and_identity(saved_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": p}) for i, p in enumerate(["def f(x):", "import os\n", "ab"])))
    out = tmp_path / "r.json"
    report = bench_decode.main(
        ["--model", str(saved_model), "--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "12",
         "--configs", "3,2,2;4,3,3", "--pool", "both", "--dtype", "float32", "--fp32-reference", "--json", str(out)]
    )
    names = [r["config"] for r in report["rows"]]
    assert names == ["hf-greedy", "hf-pld3", "hf-pld10", "plain", "la(3,2,2)+prompt", "la(3,2,2)-prompt",
                     "la(4,3,3)+prompt", "la(4,3,3)-prompt"]
    ours = [r for r in report["rows"] if not r["config"].startswith("hf-pld")]
    assert all(r["identical"] == "2/2" and r["identical_fp32"] == "2/2" for r in ours)
    assert all(r["median_first_diff"] is None for r in ours)
    assert report["rows"][3]["compression"] == 1.0
    assert json.loads(out.read_text())["rows"][0]["speedup_vs_hf"] == 1.0


def test_bench_decode_counts_differences_against_a_bf16_run(saved_model, tmp_path):
    """bf16 against its own HF greedy and against float32: the identity columns are measured, not assumed."""
    report = bench_decode.main(["--model", str(saved_model), "--num-prompts", "2", "--prompt-len", "8",
                                "--max-new-tokens", "8", "--configs", "3,2,2", "--pld", "", "--dtype", "bfloat16",
                                "--fp32-reference"])
    assert report["dtype"] == "bfloat16"
    rows = {r["config"]: r for r in report["rows"]}
    assert rows["hf-greedy"]["identical"] == "2/2"
    for r in rows.values():
        assert r["identical_fp32"].endswith("/2")  # every run compared with the float32 reference
        assert (r["median_first_diff"] is None) == (r["identical"] == "2/2")


def test_first_difference():
    assert bench_decode.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench_decode.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert bench_decode.first_difference([1, 2], [1, 2, 3]) == 2

"""bench_decode end to end on a saved tiny model, offline: peers, identity columns, first differences."""
import json

import pytest

from benchmarks import bench_decode


def test_bench_decode_reports_peers_and_identity(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": p}) for i, p in enumerate(["def f(x):", "import os\n", "ab"])))
    out = tmp_path / "r.json"
    report = bench_decode.main(
        ["--model", str(tiny_model_dir), "--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "12",
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


def test_bench_decode_counts_differences_against_a_bf16_run(tiny_model_dir, tmp_path):
    """bf16 against its own HF greedy and against float32: the identity columns are measured, not assumed."""
    report = bench_decode.main(["--model", str(tiny_model_dir), "--num-prompts", "2", "--prompt-len", "8",
                                "--max-new-tokens", "8", "--configs", "3,2,2", "--pld", "", "--dtype", "bfloat16",
                                "--fp32-reference"])
    assert report["dtype"] == "bfloat16"
    rows = {r["config"]: r for r in report["rows"]}
    assert rows["hf-greedy"]["identical"] == "2/2"
    for r in rows.values():
        assert r["identical_fp32"].endswith("/2")  # every run compared with the float32 reference
        assert (r["median_first_diff"] is None) == (r["identical"] == "2/2")


def test_a_pinned_row_price_sets_how_many_tree_rows_a_whole_step_keeps(tiny_model_dir):
    """--row-price 0 runs every proposed row; a price above any row's chance runs none, and the
    output stays identical either way."""
    widths = {}
    for price in ("0", "100"):
        report = bench_decode.main(["--model", str(tiny_model_dir), "--num-prompts", "2", "--prompt-len", "8",
                                    "--max-new-tokens", "16", "--configs", "3,2,2,4,16 fixed", "--pld", "",
                                    "--no-plain", "--dtype", "float32", "--engine-compile", "off",
                                    "--row-price", price])
        row = report["rows"][1]
        assert row["identical"] == "2/2"
        assert row["host_ms_per_step"] > 0 and report["rows"][0]["host_ms_per_step"] is None  # ours; HF has no steps
        kinds = row["steps_by_kind"]
        steps = sum(kinds.values())
        assert kinds["plain"] == 2  # each prompt's first token, from its prefill
        widths[price] = (row["mean_width"] * steps - 2) / (steps - 2)  # the mean width of the whole steps
    assert widths["100"] == pytest.approx(1 + 2 * 2)  # the last token and the window: no row is worth 100 steps
    assert widths["0"] > widths["100"]
    with pytest.raises(SystemExit):
        bench_decode.main(["--model", str(tiny_model_dir), "--row-price", "0"])  # needs the long-lived engine


def test_first_difference():
    assert bench_decode.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench_decode.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert bench_decode.first_difference([1, 2], [1, 2, 3]) == 2


@pytest.mark.compile
def test_compiled_greedy_peer_matches_hf_greedy_and_stops_at_eos():
    """The compiled decode step (StaticCache, inductor freezing) gives HF eager greedy's tokens on
    prompts of two lengths, reuses its one graph after a cache reset, and stops at EOS as HF does."""
    import torch

    from lookahead_core.models.random_models import build_random_model

    def hf_greedy(model, prompt, max_new):
        return bench_decode.run_hf(model, prompt, max_new)[0]

    model = build_random_model("llama", vocab_size=128)
    prompts = [[5, 9, 17, 33, 2, 70, 101], [44, 3, 90, 12, 7, 7, 64, 8, 31, 120, 6]]
    peer = bench_decode.CompiledGreedy(model, max_cache_len=max(map(len, prompts)) + 10, gemm_autotune=False)
    assert peer.warm_up(prompts[0]) > 0
    frames = torch._dynamo.utils.counters["frames"]
    compiled = frames["ok"]
    for prompt in prompts:
        tokens, seconds = peer.generate(prompt, 10)
        assert tokens == hf_greedy(model, prompt, 10) and seconds > 0
    assert frames["ok"] == compiled  # no recompile across prompts and cache resets
    stop = tokens[4]
    model.generation_config.eos_token_id = stop
    peer.eos = {stop}
    tokens, _ = peer.generate(prompts[1], 10)
    assert tokens == hf_greedy(model, prompts[1], 10) and tokens[-1] == stop and len(tokens) <= 5


@pytest.mark.compile
def test_bench_decode_compiled_peer_row(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": p}) for i, p in enumerate(["def f(x):", "import os\n"])))
    report = bench_decode.main(["--model", str(tiny_model_dir), "--prompts", str(prompts), "--max-new-tokens", "8",
                                "--configs", "", "--pld", "", "--no-plain", "--compiled", "--peer-skip-guards",
                                "--dtype", "float32", "--compile-autotune", "off"])
    rows = {r["config"]: r for r in report["rows"]}
    assert list(rows) == ["hf-greedy", "hf-compiled", "hf-compiled-ng"]
    for name in ("hf-compiled", "hf-compiled-ng"):  # each peer compiled its own graph
        assert rows[name]["identical"] == "2/2" and rows[name]["compression"] == 1.0
        assert report["hf_compiled"][name]["recompiles"] == 0 and report["hf_compiled"][name]["compile_s"] > 0
    assert report["machine"]["cpu_capability"]

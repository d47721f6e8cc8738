"""bench_builds: two checkouts' bench_decode, interleaved, with their ratios."""
from pathlib import Path

from benchmarks import bench_builds

ROOT = Path(__file__).resolve().parents[2]


def test_one_checkout_against_itself_gives_both_builds_every_figure(tiny_model_dir):
    report = bench_builds.main(["--before", str(ROOT), "--after", str(ROOT), "--rounds", "1", "--",
                                "--model", str(tiny_model_dir), "--num-prompts", "1", "--prompt-len", "8",
                                "--max-new-tokens", "8", "--configs", "3,2,2", "--pld", "", "--no-plain",
                                "--dtype", "float32", "--engine-compile", "off"])
    assert set(report) == {f"{c}/{b}" for c in ("hf-greedy", "la(3,2,2)") for b in ("before", "after")}
    ours = report["la(3,2,2)/after"]
    assert ours["tokens_per_s"] > 0 and ours["host_ms_per_step"] > 0 and ours["identical"] == ["1/1"]
    assert report["hf-greedy/before"]["host_ms_per_step"] is None  # HF runs no engine steps

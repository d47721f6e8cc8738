"""bench_engine: the engine eager and compiled side by side, same prompts."""
import pytest

from benchmarks import bench_engine


@pytest.mark.compile
def test_eager_and_compiled_rows_with_their_ratio(capsys, tmp_path):
    report = bench_engine.main(["--model", "random:tiny", "--prompts", "", "--concurrency", "1,2", "--max-new-tokens", "8",
                                "--configs", "3,2,2", "--engine-compile", "off,on", "--compile-dir", str(tmp_path),
                                "--min-requests", "2", "--requests-per-level", "1"])
    rows = report["rows"]
    for name in ("engine plain", "engine plain compiled", "engine la(3,2,2)", "engine la(3,2,2) compiled"):
        assert [rows[name][c]["tokens"] for c in ("1", "2")] == [16, 16], name  # 2 requests of 8 tokens each (no EOS)
    assert report["compile_s"] > 0 and report["device"].startswith("cpu ")
    out = capsys.readouterr().out
    assert "engine plain compiled / eager: c=1" in out and "0 decode forwards ran eagerly" in out

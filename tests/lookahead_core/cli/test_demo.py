"""The demo CLI and the benchmark run end to end on a saved tiny model, offline."""

import pytest

from lookahead_core.cli import demo


def test_demo_prints_completion_speed_and_identity(tiny_model_dir, capsys):
    code = demo.main(
        ["--model", str(tiny_model_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "16", "--n", "3", "--w", "3", "--g", "3"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("def add(a, b):")
    assert "compression" in out and "speedup vs plain" in out and "outputs identical: True" in out


def test_demo_rejects_bad_params(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--model", str(tiny_model_dir), "--prompt", "x", "--n", "1"])
    assert exc.value.code == 2
    assert "n must be >= 2" in capsys.readouterr().err

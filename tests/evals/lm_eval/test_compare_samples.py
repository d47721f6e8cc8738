import json

import pytest

from evals.lm_eval import compare_samples


def _write(root, capitals, arithmetic):
    root.mkdir()
    (root / "samples_ls_capitals_2026.jsonl").write_text("\n".join(json.dumps(s) for s in capitals))
    (root / "samples_ls_arithmetic_2026.jsonl").write_text("\n".join(json.dumps(s) for s in arithmetic))


def _cap(i, lls, acc):
    return {"doc_id": i, "resps": [[[str(v), "False"]] for v in lls], "acc": acc}


def _gen(i, text, em):
    return {"doc_id": i, "resps": [[text]], "exact_match": em}


def test_reports_the_largest_difference_and_agreement(tmp_path, capsys):
    _write(tmp_path / "a", [_cap(0, [-1.0, -2.0], 1.0), _cap(1, [-3.0, -1.0], 0.0)], [_gen(0, " 5", 1.0), _gen(1, " 7", 0.0)])
    _write(tmp_path / "b", [_cap(0, [-1.0, -2.5], 1.0), _cap(1, [-0.5, -1.0], 1.0)], [_gen(0, " 5", 1.0), _gen(1, " 8", 0.0)])
    compare_samples.main([str(tmp_path / "a"), str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert "max |difference| 2.50e+00" in out and "same choice 1/2" in out and "acc 0.500 vs 1.000" in out
    assert "identical generations 1/2" in out


def test_different_documents_are_an_error(tmp_path):
    _write(tmp_path / "a", [_cap(0, [-1.0], 1.0)], [_gen(0, "x", 0.0)])
    _write(tmp_path / "b", [_cap(1, [-1.0], 1.0)], [_gen(0, "x", 0.0)])
    with pytest.raises(SystemExit, match="different documents"):
        compare_samples.main([str(tmp_path / "a"), str(tmp_path / "b")])

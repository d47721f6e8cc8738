"""tiny-pycoder, the small code model kept for fast tests: small, offline, real, and exact under lookahead."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lookahead_core import LookaheadParams, generate

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tiny-pycoder"
PROMPTS = ROOT / "benchmarks" / "prompts"


@pytest.fixture(scope="module")
def loaded():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(MODEL).eval(), AutoTokenizer.from_pretrained(MODEL)


def test_fits_in_30_mb():
    assert sum(f.stat().st_size for f in MODEL.iterdir()) <= 30 * 1024 * 1024


def test_loads_offline_in_under_5_seconds():
    # The clock starts after the imports: torch and transformers alone take ~4 s on a slow 2-core VM.
    code = ("import time; from transformers import AutoModelForCausalLM, AutoTokenizer; t = time.perf_counter(); "
            f"AutoModelForCausalLM.from_pretrained({str(MODEL)!r}); AutoTokenizer.from_pretrained({str(MODEL)!r}); "
            "print(time.perf_counter() - t)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert float(out.stdout.strip().splitlines()[-1]) < 5.0


def test_tokenizer_round_trips_code(loaded):
    _, tok = loaded
    src = 'def f(x):\n    """Doc."""\n    return {"a": x ** 2}  # ok\n'
    assert tok.decode(tok(src)["input_ids"]) == src
    assert 6000 <= len(tok) <= 9000


def test_prompt_sets():
    code = [json.loads(line) for line in (PROMPTS / "code.jsonl").read_text().splitlines()]
    text = [json.loads(line) for line in (PROMPTS / "text.jsonl").read_text().splitlines()]
    assert len(code) >= 100 and len(text) >= 50
    assert len({r["id"] for r in code + text}) == len(code) + len(text)
    assert all(r["prompt"].startswith(("def ", "async def ")) and r["reference"] for r in code)
    held = set(json.loads((MODEL / "corpus.json").read_text())["heldout_files"])
    assert all(f"{r['origin']}/{r['file']}" in held for r in code)


def test_lookahead_equals_hf_greedy_on_held_out_code(loaded):
    model, tok = loaded
    rows = [json.loads(line) for line in (PROMPTS / "code.jsonl").read_text().splitlines()][:6]
    steps = tokens = 0
    for row in rows:
        ids = torch.tensor([tok(row["prompt"])["input_ids"]])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)[0, ids.shape[1]:].tolist()
        res = generate(model, ids, max_new_tokens=48, params=LookaheadParams())
        assert res.tokens == ref, row["id"]
        steps += res.stats.steps
        tokens += len(res.tokens)
    assert tokens / steps > 1.2  # a trained model on code: real n-gram hits

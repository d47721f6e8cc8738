"""Time to first token in-process: one long-lived engine, chat prompts one at a time, each mode
("off", then "auto", the engine's learned tables and stored prefixes cleared before each) sent
twice: the first pass meets only the chat template's stored prefix, the second the whole prompt.

    PYTHONPATH=<checkout> python <this checkout>/benchmarks/bench_ttft.py --dtype auto

Run by path with another checkout on PYTHONPATH, it times that checkout's engine (builds compared
on one machine). TTFT is from `add_request` to the first output holding tokens (p50, ms).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import lookahead_core
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.io import EngineRequest
from lookahead_core.lookahead.stopping import StopCondition
from lookahead_core.models.loading import DEFAULT_MODEL, load_model

PROMPTS = Path(__file__).resolve().parent / "prompts" / "chat.jsonl"


def first_token_ms(engine: Engine, rid: str, prompt: tuple[int, ...], mode: str, max_new: int) -> float:
    engine.add_request(EngineRequest(rid, prompt, StopCondition(max_new), mode))  # type: ignore[arg-type]
    t0, first = time.perf_counter(), None
    while engine.has_work():
        for out in engine.step():
            if out.tokens and first is None:
                first = time.perf_counter() - t0
    assert first is not None, "a request that produced no token"
    return 1000 * first


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--prompts", default=str(PROMPTS), help="JSONL with `prompt`, sent as one user turn each")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    model, tok = load_model(args.model, dtype=args.dtype)
    texts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    def ids(text: str) -> tuple[int, ...]:
        if tok.chat_template is None:  # a model without one: the text alone
            return tuple(tok(text)["input_ids"])
        return tuple(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False))

    prompts = [ids(t) for t in texts[: args.num_prompts]]
    engine = Engine(model, EngineConfig(max_batch=1, max_seq_len=1024, max_new_tokens=args.max_new_tokens))
    report = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "dtype": str(model.dtype),
              "threads": torch.get_num_threads(), "package": str(Path(lookahead_core.__file__).parent.parent)}
    for mode in ("off", "auto"):
        engine.knowledge.clear()  # each mode meets the prompts new, then again
        if engine.runner.prefixes is not None:
            engine.runner.prefixes.clear()
        for rep, name in enumerate(("new", "repeat")):
            ms = [first_token_ms(engine, f"{mode}-{rep}-{i}", p, mode, args.max_new_tokens) for i, p in enumerate(prompts)]
            report[f"{mode}/{name}"] = round(statistics.median(ms), 1)
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

"""Which grammar library fits lookahead's step: each JSON-schema task's grammar, in-process, no server.

A lookahead step verifies a tree of candidate rows; under a grammar every row needs the mask of
the tokens legal after its path, the matcher advanced along the path and taken back to the
accepted prefix, and forced text (the keys, the separators) is what the tree can propose for free.
So per library, over every task of benchmarks/prompts/json_schema_tasks.jsonl, walking each task's
valid `example` (serialized in the key order the grammar takes, tokenized by the served model's
tokenizer) one token at a time: the grammar's build, the mask of one row (a bitmask of the whole
vocabulary, cold: the matcher's first visit of each state, and warm: a second walk), consuming a
token, rolling back a draft of 4, copying a matcher (one per tree branch), the masks of a draft
chain of 5 rows computed one by one against the library's one-call draft API, and the forced-token
API: the tokens it hands out that are the example's own next tokens (lookahead verifies those like
any candidate), and the positions where exactly one token is legal.

Both libraries get the served grammar: `GrammarSpec.json_schema`'s JSON text in the server's fixed
layout (", " and ": ", no free whitespace). One thread per call, as the engine
asks for one row's mask at a time; llguidance's `LLExecutor` and xgrammar's batch matcher spread
rows over threads, not measured here.

    python -m benchmarks.bench_grammar                         # llguidance (the server's library) alone
    pip install --no-deps --target /tmp/xgr xgrammar apache-tvm-ffi
    python -m benchmarks.bench_grammar --xgrammar /tmp/xgr     # and xgrammar, from that folder only
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks.bench_structured import TASKS, read_tasks
from loadtests.client import percentiles
from lookahead_core.constraints.grammar import JSON_LAYOUT, GrammarSpec, grammar_tokenizer

ROOT = Path(__file__).resolve().parent.parent
DRAFT = 4  # a draft's tokens past the row it starts from: a chain of DRAFT + 1 rows
SEPARATORS = (JSON_LAYOUT["item_separator"], JSON_LAYOUT["key_separator"])


class Llguidance:
    """llguidance as the engine drives it (lookahead_core/constraints/grammar.py)."""

    name = "llguidance"

    def __init__(self, tokenizer, vocab: int) -> None:
        import llguidance
        import llguidance.numpy
        import llguidance.torch

        self.lib, self.vocab = llguidance, vocab
        self.tokenizer = grammar_tokenizer(tokenizer, vocab)
        self.version = llguidance.get_version() if hasattr(llguidance, "get_version") else "?"
        self.executor = llguidance.LLExecutor(num_threads=1)
        self.row = llguidance.numpy.allocate_token_bitmask(1, vocab)
        self.chain_buf = llguidance.numpy.allocate_token_bitmask(DRAFT + 1, vocab)
        self.forced_api = "compute_ff_tokens: the forced bytes, tokenized canonically"
        self.chain_api = "fill_next_token_bitmask_par_with_draft_tokens: a draft chain's masks in one call"

    def build(self, spec: GrammarSpec):
        m = self.lib.LLMatcher(self.tokenizer, spec.llguidance(), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask(self, m) -> np.ndarray:
        m.unsafe_compute_mask_ptr(self.row.ctypes.data, self.row.nbytes)
        return self.row

    def consume(self, m, token: int) -> bool:
        return m.consume_token(token)

    def rollback(self, m, n: int) -> None:
        assert m.rollback(n), m.get_error()

    def copy(self, m):
        return m.deep_copy()

    def forced(self, m) -> list[int]:
        return m.compute_ff_tokens()

    def chain(self, m, path: list[int]) -> None:
        self.lib.numpy.fill_next_token_bitmask_par_with_draft_tokens(self.executor, [(m, 0, path)], self.chain_buf)

    def accepting(self, m) -> bool:
        return m.is_accepting()

    def apply(self, logits, bitmask) -> None:
        self.lib.torch.apply_token_bitmask_inplace(logits, bitmask)


class Xgrammar:
    """xgrammar, imported from a folder of its own (its pip dependencies would bring triton)."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, folder: str) -> None:
        sys.path.insert(0, folder)
        import torch
        import xgrammar

        self.lib, self.torch, self.vocab = xgrammar, torch, vocab
        self.version = getattr(xgrammar, "__version__", None) or _dist_version(folder, "xgrammar")
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.row = xgrammar.allocate_token_bitmask(1, vocab)
        self.chain_buf = xgrammar.allocate_token_bitmask(DRAFT + 1, vocab)
        self.forced_api = "find_jump_forward_tokens: greedy longest vocabulary match of the forced string"
        self.chain_api = "traverse_draft_tree: a draft tree's masks in one call"
        # a chain: node i's child is node i + 1, no siblings
        self.next_token = torch.tensor([*range(1, DRAFT + 1), -1], dtype=torch.int64)
        self.next_sibling = torch.full((DRAFT + 1,), -1, dtype=torch.int64)

    def build(self, spec: GrammarSpec):
        compiler = self.lib.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)  # every build timed whole
        compiled = compiler.compile_json_schema(spec.source, any_whitespace=False, separators=SEPARATORS)
        return self.lib.GrammarMatcher(compiled)

    def mask(self, m) -> np.ndarray:
        m.fill_next_token_bitmask(self.row)
        return self.row.numpy()

    def consume(self, m, token: int) -> bool:
        return m.accept_token(token)

    def rollback(self, m, n: int) -> None:
        m.rollback(n)

    def copy(self, m):
        return m.fork()

    def forced(self, m) -> list[int]:
        return list(m.find_jump_forward_tokens())

    def chain(self, m, path: list[int]) -> None:
        tokens = self.torch.tensor([0, *path], dtype=self.torch.int64)  # node 0: the row the path starts from
        m.traverse_draft_tree(self.next_token, self.next_sibling, tokens, self.chain_buf)

    def accepting(self, m) -> bool:
        return m.is_completed() or m.accept_token(self.info.stop_token_ids[0])

    def apply(self, logits, bitmask) -> None:
        self.lib.apply_token_bitmask_inplace(logits, bitmask)


def _dist_version(folder: str, name: str) -> str:
    found = sorted(Path(folder).glob(f"{name}-*.dist-info"))
    return found[-1].name.removeprefix(f"{name}-").removesuffix(".dist-info") if found else "?"


def ordered(value: Any, schema: dict) -> Any:
    """`value` with every object's keys in its schema's `properties` order."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return {k: ordered(value[k], props.get(k, {})) for k in props if k in value}
    if isinstance(value, list):
        return [ordered(v, schema.get("items", {})) for v in value]
    return value


def example_tokens(task: dict, tokenizer, fits: Callable[[list[int]], bool]) -> tuple[list[int], str]:
    """The task's example as the grammar takes it (the schema's key order or sorted keys, the fixed
    layout), tokenized canonically; which order it was."""
    for order, value in (("schema", ordered(task["example"], task["schema"])), ("sorted", task["example"])):
        text = json.dumps(value, sort_keys=order == "sorted", separators=SEPARATORS)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if fits(ids):
            return ids, order
    raise ValueError(f"task {task['name']}: the grammar takes its example in neither key order")


def timed(fn: Callable, *args) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return (time.perf_counter() - t0) * 1e6, out  # us


def walk(lib, task: dict, tokenizer) -> dict:
    """One task's figures under `lib` (times in us)."""
    spec = GrammarSpec.json_schema(task["schema"])

    def fits(ids: list[int]) -> bool:  # on a grammar of its own: the timed one meets every state first in the walk
        m = lib.build(spec)
        return all(lib.consume(m, t) for t in ids) and lib.accepting(m)

    ids, order = example_tokens(task, tokenizer, fits)
    build_us, built = timed(lib.build, spec)
    out: dict[str, Any] = {"task": task["name"], "tokens": len(ids), "key_order": order, "build_us": build_us,
                           "cold_mask_us": [], "warm_mask_us": [], "consume_us": [], "rollback_us": [], "copy_us": [],
                           "forced_us": [], "serial_chain_us": [], "one_call_chain_us": [], "single_legal": 0,
                           "forced_on_answer": 0, "forced_handed": 0}
    m = lib.copy(built)
    for p, token in enumerate(ids):  # cold: the first visit of each state
        us, row = timed(lib.mask, m)
        out["cold_mask_us"].append(us)
        out["single_legal"] += int(np.bitwise_count(row.view(np.uint32)).sum()) == 1
        us, _ = timed(lib.copy, m)
        out["copy_us"].append(us)
        us, _ = timed(lib.consume, m, token)
        out["consume_us"].append(us)
        if p + 1 >= DRAFT:
            us, _ = timed(lib.rollback, m, DRAFT)
            out["rollback_us"].append(us)
            for t in ids[p + 1 - DRAFT : p + 1]:
                assert lib.consume(m, t)
    m = lib.copy(built)
    for p, token in enumerate(ids):  # warm: the same states again, one row and a chain of rows from each
        us, _ = timed(lib.mask, m)
        out["warm_mask_us"].append(us)
        path = ids[p : p + DRAFT]
        if len(path) == DRAFT:
            out["serial_chain_us"].append(serial_chain(lib, m, path) / (DRAFT + 1))
            us, _ = timed(lib.chain, m, path)
            out["one_call_chain_us"].append(us / (DRAFT + 1))
        assert lib.consume(m, token)
    m = lib.copy(built)
    p = 0
    while p < len(ids):  # the forced tokens the grammar hands out along the answer, taken where they are its own
        us, forced = timed(lib.forced, m)
        out["forced_us"].append(us)
        agree = 0
        while agree < len(forced) and p + agree < len(ids) and forced[agree] == ids[p + agree]:
            agree += 1
        out["forced_handed"] += len(forced)
        out["forced_on_answer"] += agree
        for t in ids[p : p + max(agree, 1)]:
            assert lib.consume(m, t)
        p += max(agree, 1)
    return out


def serial_chain(lib, m, path: list[int]) -> float:
    """us for the masks of the rows along `path` one by one: mask, consume, ..., mask, then rollback."""
    t0 = time.perf_counter()
    lib.mask(m)
    for t in path:
        assert lib.consume(m, t)
        lib.mask(m)
    lib.rollback(m, len(path))
    return (time.perf_counter() - t0) * 1e6


def apply_us(lib, rows: int, repeat: int = 200) -> float:
    """us to set the refused tokens of `rows` float32 logits rows [rows, V] to -inf from their bitmasks
    (the library's own CPU kernel), the fastest of `repeat` calls."""
    import torch

    logits = torch.randn(rows, lib.vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (lib.vocab + 31) // 32), dtype=torch.int32)
    return min(timed(lib.apply, logits, bitmask)[0] for _ in range(repeat))


def engine_row_us(task: dict, tokenizer, vocab: int, repeat: int = 200) -> float | None:
    """us for the engine's own masking of one row today (`GrammarState.mask_`: llguidance's mask,
    unpacked to bools, `masked_fill_`) at the start of a task's answer, the fastest of `repeat` calls."""
    import torch

    from lookahead_core.constraints import grammar

    if not hasattr(grammar, "Grammars"):
        return None
    state = grammar.Grammars(grammar_tokenizer(tokenizer, vocab), vocab).matcher(GrammarSpec.json_schema(task["schema"]))
    row = torch.randn(vocab)
    return min(timed(state.mask_, row)[0] for _ in range(repeat))


def summary(lib, rows: list[dict]) -> dict:
    """Every task's rows together: percentiles in ms (masks, per row) or us."""
    def pool(key: str) -> list[float]:
        return [v for r in rows for v in r[key]]

    def pct(key: str, scale: float = 1.0) -> dict:
        return {k: None if v is None else round(v * scale, 4) for k, v in percentiles(pool(key), (50, 95)).items()}

    tokens = sum(r["tokens"] for r in rows)
    return {"library": lib.name, "version": lib.version, "tasks": len(rows), "tokens": tokens,
            "build_ms": {**{k: round(v / 1e3, 2) for k, v in percentiles([r["build_us"] for r in rows], (50, 95)).items()},
                         "max": round(max(r["build_us"] for r in rows) / 1e3, 2)},
            "mask_ms_cold": pct("cold_mask_us", 1e-3), "mask_ms_warm": pct("warm_mask_us", 1e-3),
            "consume_us": pct("consume_us"), "rollback_4_us": pct("rollback_us"), "copy_us": pct("copy_us"),
            "forced_us": pct("forced_us"), "chain_serial_us_per_row": pct("serial_chain_us"),
            "chain_one_call_us_per_row": pct("one_call_chain_us"),
            "forced_on_answer": sum(r["forced_on_answer"] for r in rows),
            "forced_handed": sum(r["forced_handed"] for r in rows),
            "single_legal": sum(r["single_legal"] for r in rows),
            "apply_us": {"1": round(apply_us(lib, 1), 2), "32": round(apply_us(lib, 32), 2)},
            "forced_api": lib.forced_api, "chain_api": lib.chain_api}


def p(d: dict, scale: str = "") -> str:
    return f"{d['p50']}/{d['p95']}{scale}"


def report(s: dict) -> list[str]:
    t = s["tokens"]
    return [f"{s['library']} {s['version']}: {s['tasks']} schemas, {t} answer tokens",
            f"  build ms p50/p95/max {s['build_ms']['p50']}/{s['build_ms']['p95']}/{s['build_ms']['max']}",
            f"  mask ms per row p50/p95: warm {p(s['mask_ms_warm'])}, cold (first visit) {p(s['mask_ms_cold'])}",
            f"  consume us {p(s['consume_us'])}, rollback of {DRAFT} us {p(s['rollback_4_us'])}, copy us {p(s['copy_us'])}",
            f"  a chain of {DRAFT + 1} rows, us per row: one by one {p(s['chain_serial_us_per_row'])}, "
            f"one call {p(s['chain_one_call_us_per_row'])} ({s['chain_api']})",
            f"  applying masks to float32 logits, us: 1 row {s['apply_us']['1']}, 32 rows {s['apply_us']['32']}",
            f"  forced tokens handed out along the answers {s['forced_handed']}, the answers' own {s['forced_on_answer']} "
            f"({s['forced_on_answer'] / t:.0%} of their {t} tokens), us per call {p(s['forced_us'])} ({s['forced_api']}); "
            f"positions with one legal token {s['single_legal']} ({s['single_legal'] / t:.0%})"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default=str(TASKS))
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the served config's model folder)")
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--xgrammar", default=None, metavar="FOLDER",
                    help="also measure xgrammar, imported from FOLDER (pip install --no-deps --target FOLDER xgrammar apache-tvm-ffi)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from benchmarks.bench_serving import served_folder

    torch.set_num_threads(1)  # one row's mask is one thread's work; torch's pool would wait on a busy host's cores
    folder = args.tokenizer or served_folder(yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = len(tokenizer)
    tasks = read_tasks(args.tasks)
    libs: list[Any] = [Llguidance(tokenizer, vocab)]
    notes = []
    if args.xgrammar:
        try:
            libs.append(Xgrammar(tokenizer, vocab, args.xgrammar))
        except Exception as exc:  # what stopped it is the finding
            notes.append(f"xgrammar from {args.xgrammar} did not import: {type(exc).__name__}: {exc}")
    print(f"cpu_capability={torch.backends.cpu.get_cpu_capability()} cores={os.cpu_count()} torch_threads=1 "
          f"load={' '.join(f'{x:.2f}' for x in os.getloadavg())} tokenizer={Path(folder).name} vocab={vocab}", flush=True)
    results: dict[str, Any] = {"tokenizer": folder, "vocab": vocab, "notes": notes, "libraries": []}
    for lib in libs:
        rows = [walk(lib, t, tokenizer) for t in tasks]
        s = summary(lib, rows)
        results["libraries"].append({**s, "per_task": [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows]})
        for line in report(s):
            print(line, flush=True)
        for r in rows:
            print(f"    {r['task']:<20} {r['tokens']:>4} tokens ({r['key_order']} key order), forced {r['forced_on_answer']:>3}, "
                  f"one legal {r['single_legal']:>3}, build {r['build_us'] / 1e3:7.2f} ms, "
                  f"warm mask p50 {percentiles(r['warm_mask_us'], (50,))['p50'] / 1e3:.4f} ms")
    engine = engine_row_us(tasks[0], tokenizer, vocab)
    results["engine_row_us"] = engine
    if engine is not None:
        print(f"the engine's row today (GrammarState.mask_: llguidance's mask, unpacked to bools, masked_fill_), "
              f"{tasks[0]['name']}'s first row: {engine:.1f} us")
    for note in notes:
        print(note)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()

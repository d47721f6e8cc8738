"""Decode speed of one sequence against its peers, in one process, on one model and dtype.

Configurations: HF greedy `generate`, HF compiled greedy (`--compiled`: a StaticCache and a
`torch.compile`d one-token decode step, inductor freezing on CPU, as gpt-fast), HF prompt-lookup
decoding (`prompt_lookup_num_tokens`), our plain path and our lookahead grid. Every prompt runs
every configuration back to back (rotating the order), so drift in machine speed hits all of
them alike. Speedups are ratios of total tokens/s over the same prompts. Identity is measured
against HF greedy in the same dtype and, with --fp32-reference, against HF greedy in float32 (how
far bf16 itself moves the text).

    python -m benchmarks.bench_decode --prompts benchmarks/prompts/chat.jsonl --chat --dtype bfloat16
    python -m benchmarks.bench_decode --model random:small --num-prompts 8 --max-new-tokens 128
    python -m benchmarks.bench_decode --prompts benchmarks/prompts/chat.jsonl --chat --num-prompts 8 \
        --dtype float32 --compiled --configs 3,2,2 --pld "" --no-plain   # HF eager, HF compiled, our default
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from transformers import StaticCache

from lookahead_core import LookaheadParams, ModelRunner, SamplingParams, generate
from lookahead_core.cli.prompt_sets import read_prompt_set
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.generation import GenerationStats
from lookahead_core.engine.host.status import graph_status
from lookahead_core.engine.io import EngineRequest
from lookahead_core.lookahead.stopping import StopCondition
from lookahead_core.models.loading import DEFAULT_MODEL, load_model

SKIP_GUARDS_PEER = "hf-compiled-ng"  # the compiled peer without dynamo's guards on the model


def peer_options(cuda: bool, gemm_autotune: bool) -> dict:
    """The HF compiled peer's inductor settings on CPU: freezing (weights folded and packed once)
    and, with `gemm_autotune`, every linear layer timed between inductor's C++ GEMM template and
    the library kernels; on CUDA nothing (CUDA graphs come from the backend options)."""
    if cuda:
        return {}
    options: dict = {"freezing": True}
    if gemm_autotune:
        options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN", max_autotune_report_choices_stats=False)
    return options


@dataclass
class Config:
    name: str
    kind: str  # "hf" | "hf-compiled" | "hf-pld" | "plain" | "lookahead"
    params: LookaheadParams | None = None
    pld_tokens: int = 0


@dataclass
class Tally:
    seconds: list[float] = field(default_factory=list)
    tokens: int = 0
    steps: int = 0
    forward_s: float = 0.0
    decode_s: float = 0.0
    same: int = 0  # token-identical to HF greedy, same dtype
    first_diff: list[int] = field(default_factory=list)
    same_fp32: int = 0
    runs: int = 0
    distinct4: list[float] = field(default_factory=list)
    rows: int = 0  # step rows our engine fed the model
    kinds: Counter = field(default_factory=Counter)  # steps by kind
    proposed: Counter = field(default_factory=Counter)  # tree rows by source
    accepted: Counter = field(default_factory=Counter)


def parse_configs(spec: str, pool: str, pld: str, sampling: bool, plain: bool = True,
                  compiled: bool = False, skip_guards: bool = False) -> list[Config]:
    configs = [Config("hf-sample" if sampling else "hf-greedy", "hf")]
    if compiled and not sampling:  # a greedy peer: argmax inside the compiled step
        configs.append(Config("hf-compiled", "hf-compiled"))
        if skip_guards:
            configs.append(Config(SKIP_GUARDS_PEER, "hf-compiled"))
    if not sampling:  # HF refuses prompt lookup with sampling in some versions; it is a greedy peer here
        configs += [Config(f"hf-pld{k}", "hf-pld", pld_tokens=int(k)) for k in pld.split(",") if k.strip()]
    if plain:
        configs.append(Config("plain", "plain"))
    pools = {"on": [True], "off": [False], "both": [True, False]}[pool]
    for item in spec.split(";"):
        if not item.strip():
            continue
        params = LookaheadParams.parse(item)
        for from_prompt in pools:
            suffix = "" if len(pools) == 1 else ("+prompt" if from_prompt else "-prompt")
            p = dataclasses.replace(params, pool_from_prompt=from_prompt)
            configs.append(Config(f"la{p.label}{suffix}", "lookahead", p))
    return configs


def load_prompts(path: str | None, tokenizer, count: int | None, vocab: int, length: int, chat: bool = False) -> list[list[int]]:
    if path is None:
        gen = torch.Generator().manual_seed(0)
        return [torch.randint(2, vocab, (length,), generator=gen).tolist() for _ in range(count or 8)]
    try:
        return read_prompt_set(path, tokenizer, count, chat)
    except ValueError as exc:
        sys.exit(str(exc))


def run_hf(model, prompt: list[int], max_new: int, sampling: SamplingParams | None = None, pld_tokens: int = 0):
    ids = torch.tensor([prompt], device=model.device)
    kw: dict = {"do_sample": False}
    if sampling is not None:
        kw = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k or None, "top_p": sampling.top_p}
    if pld_tokens:
        kw["prompt_lookup_num_tokens"] = pld_tokens
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, pad_token_id=0, **kw)
    return out[0, len(prompt) :].tolist(), time.perf_counter() - t0, None


def decode_one_token(model, token: torch.Tensor, position: torch.Tensor, cache: StaticCache) -> torch.Tensor:
    """gpt-fast's decode step: one token [1, 1] at `position` [1, 1] into the static cache, its argmax [1]."""
    logits = model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits
    return logits[:, -1].argmax(dim=-1)


class CompiledGreedy:
    """HF greedy decoding with the decode step compiled: a StaticCache of `max_cache_len` tokens,
    an eager prefill over the prompt, then `decode_one_token` under `torch.compile` (fullgraph,
    static shapes; on CPU inductor freezing folds and packs the weights once). The cache is reset
    between prompts, so one graph serves every prompt; it stops at the model's EOS as `generate`.

    `transformers`' own `generate(cache_implementation="static")` compiles only on CUDA, and with
    freezing it folds the cache's static-address tensors into constants; hence this loop."""

    def __init__(self, model, max_cache_len: int, gemm_autotune: bool = True, skip_module_guards: bool = False) -> None:
        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        self.max_cache_len = max_cache_len
        cuda = model.device.type == "cuda"
        self.freezing = not cuda  # freezing is a CPU optimization; CUDA gets CUDA graphs
        self.options = peer_options(cuda, gemm_autotune)
        backend: dict = {"triton.cudagraphs": True} if cuda else {}
        if skip_module_guards:
            backend["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        # isolated: two peers in one process must not run each other's graph
        self.step = torch.compile(decode_one_token, fullgraph=True, dynamic=False, options=backend,
                                  isolate_recompiles=True)
        eos = getattr(model.generation_config, "eos_token_id", None)
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.compile_s: float | None = None

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new: int) -> tuple[list[int], float]:
        if len(prompt) + max_new > self.max_cache_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + {max_new} new tokens exceeds the static cache "
                             f"of {self.max_cache_len}")
        t0 = time.perf_counter()
        self.cache.reset()
        device = self.model.device
        ids = torch.tensor([prompt], device=device)
        positions = torch.arange(len(prompt), device=device).unsqueeze(0)
        logits = self.model(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True,
                            logits_to_keep=1).logits
        token = logits[:, -1].argmax(dim=-1)
        out = [int(token)]
        position = torch.tensor([[len(prompt)]], device=device)
        with inductor_config.patch(**self.options):  # inductor reads them when it compiles
            while len(out) < max_new and out[-1] not in self.eos:
                token = self.step(self.model, token.view(1, 1), position, self.cache)
                out.append(int(token))  # the step's one sync
                position.add_(1)
        return out, time.perf_counter() - t0

    def warm_up(self, prompt: list[int], tokens: int = 4) -> float:
        """Compile the decode step (the first calls trace and compile); the seconds it took."""
        t0 = time.perf_counter()
        self.generate(prompt[: self.max_cache_len - tokens], tokens)
        if self.compile_s is None:
            self.compile_s = time.perf_counter() - t0
        return self.compile_s


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Bench:
    """Runs the configurations on one prompt and keeps their tallies."""

    def __init__(self, model, configs: list[Config], max_new: int, sampling: SamplingParams | None,
                 max_prompt_len: int = 0, engine: EngineConfig | None = None, gemm_autotune: bool = True,
                 ours=None) -> None:
        """`model` runs the HF peers as loaded; `ours` (a second load of it, or `model` itself) runs
        our configurations, its weights laid out by our runner."""
        self.model, self.runner = model, ModelRunner(ours if ours is not None else model)
        # with an engine config, our configurations share one long-lived engine (as a replica does)
        self.engine = Engine(self.runner, engine) if engine is not None else None
        self.configs, self.max_new, self.sampling = configs, max_new, sampling
        self.tallies = {c.name: Tally() for c in configs}
        self.runs = 0
        self._learned = None  # what the engine had learned across requests as the prompt found it
        # one static cache sized to the longest prompt plus max_new_tokens: one compiled graph for all
        self.compiled = {c.name: CompiledGreedy(model, max_prompt_len + max_new, gemm_autotune, c.name == SKIP_GUARDS_PEER)
                         for c in configs if c.kind == "hf-compiled"}

    def reset(self) -> None:
        self.tallies = {c.name: Tally() for c in self.configs}
        if self.engine is not None:  # the warm-up prompt's text is no one's
            self.engine.knowledge.clear()

    def start_prompt(self) -> None:
        """Every configuration meets what the replica learned (successor table, finished text, rates) as
        earlier prompts left it, not holding this prompt's output from the configuration before it."""
        if self.engine is not None:
            self._learned = self.engine.knowledge.snapshot()

    def run(self, config: Config, prompt: list[int]) -> tuple[list[int], float]:
        if config.kind in ("hf", "hf-pld"):
            tokens, seconds, _ = run_hf(self.model, prompt, self.max_new, self.sampling, config.pld_tokens)
            stats = None
        elif config.kind == "hf-compiled":
            tokens, seconds = self.compiled[config.name].generate(prompt, self.max_new)
            stats = None
        else:
            self.runs += 1  # a new seed per sampled run
            seeded = None if self.sampling is None else SamplingParams(
                self.sampling.temperature, self.sampling.top_k, self.sampling.top_p, seed=self.runs)
            if self.engine is not None and self._learned is not None:
                self.engine.knowledge.restore(self._learned)
            t0 = time.perf_counter()
            if self.engine is not None:
                tokens, stats = self.run_engine(config, prompt, seeded)
            else:
                res = generate(self.runner, torch.tensor([prompt]), max_new_tokens=self.max_new, params=config.params,
                               sampling=seeded)
                tokens, stats = res.tokens, res.stats
            seconds = time.perf_counter() - t0
        t = self.tallies[config.name]
        t.seconds.append(seconds)
        t.tokens += len(tokens)
        # HF greedy takes one step per token; prompt lookup's steps are not reported (compression "-")
        t.steps += stats.steps if stats else (len(tokens) if config.kind in ("hf", "hf-compiled") else 0)
        if stats:
            t.rows += stats.rows
            t.kinds.update(stats.steps_by_kind)
            t.proposed.update(stats.proposed)
            t.accepted.update(stats.accepted_from)
        t.forward_s += stats.forward_s if stats else 0.0
        t.decode_s += stats.decode_s if stats else 0.0
        t.runs += 1
        grams = [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]
        t.distinct4.append(len(set(grams)) / len(grams) if grams else 1.0)
        return tokens, seconds

    def run_engine(self, config: Config, prompt: list[int], sampling: SamplingParams | None):
        engine = self.engine
        stop = StopCondition.build(self.max_new, self.model.generation_config.eos_token_id)
        req = EngineRequest(self.runs, tuple(prompt), stop, config.params or "off", sampling)
        forward_s, step_s, prefill_s = engine.forward_s, engine.step_s, engine.prefill_s
        engine.add_request(req)
        tokens, final = [], None
        while engine.has_work():
            for out in engine.step():
                tokens.extend(out.tokens)
                final = out if out.finish_reason is not None else final
        return tokens, GenerationStats(**dataclasses.asdict(final.stats), forward_s=engine.forward_s - forward_s,
                                       decode_s=(engine.step_s - step_s) - (engine.prefill_s - prefill_s))

    def compare(self, config: Config, tokens: list[int], reference: list[int], fp32: list[int] | None) -> None:
        t = self.tallies[config.name]
        diff = first_difference(tokens, reference)
        t.same += diff is None
        if diff is not None:
            t.first_diff.append(diff)
        if fp32 is not None:
            t.same_fp32 += tokens == fp32


def report_rows(bench: Bench, greedy: bool, fp32_ref: bool) -> list[dict]:
    base = bench.tallies[bench.configs[0].name]
    base_rate = base.tokens / sum(base.seconds)
    rows = []
    for config in bench.configs:
        t = bench.tallies[config.name]
        rows.append({
            "config": config.name,
            "median_s": statistics.median(t.seconds),
            "tokens_per_s": t.tokens / sum(t.seconds),
            "compression": t.tokens / t.steps if t.steps else None,
            # tokens/s ratio: equal to the time ratio for greedy, fair when sampled lengths differ
            "speedup_vs_hf": (t.tokens / sum(t.seconds)) / base_rate,
            "host_overhead": (1 - t.forward_s / t.decode_s) if t.decode_s else None,
            "host_ms_per_step": 1000 * (t.decode_s - t.forward_s) / t.steps if t.decode_s and t.steps else None,
            "identical": f"{t.same}/{t.runs}" if greedy else "n/a",
            "median_first_diff": statistics.median(t.first_diff) if greedy and t.first_diff else None,
            "identical_fp32": f"{t.same_fp32}/{t.runs}" if greedy and fp32_ref else None,
            # how repetitive the decoded text is: loops make n-gram hits cheap
            "distinct4": statistics.mean(t.distinct4),
            "mean_width": t.rows / t.steps if t.rows else None,
            "steps_by_kind": dict(t.kinds),
            "sources": {src: f"{t.accepted[src]}/{n}" for src, n in sorted(t.proposed.items())},
        })
    return rows


def print_table(rows: list[dict], title: str) -> None:
    print(title)
    print(f"{'config':<18}{'median s':>9}{'tok/s':>8}{'compr.':>7}{'vs HF':>8}{'host':>7}{'host ms':>8}{'same':>9}"
          f"{'1st diff':>9}"
          f"{'same fp32':>10}{'dist-4':>7}")
    for r in rows:
        ovh = "-" if r["host_overhead"] is None else f"{100 * r['host_overhead']:.0f}%"
        host_ms = "-" if r["host_ms_per_step"] is None else f"{r['host_ms_per_step']:.2f}"
        fd = "-" if r["median_first_diff"] is None else f"{r['median_first_diff']:.0f}"
        comp = "-" if r["compression"] is None else f"{r['compression']:.2f}"
        print(f"{r['config']:<18}{r['median_s']:>9.3f}{r['tokens_per_s']:>8.1f}{comp:>7}"
              f"{r['speedup_vs_hf']:>7.2f}x{ovh:>7}{host_ms:>8}{r['identical']:>9}{fd:>9}{r['identical_fp32'] or '-':>10}"
              f"{r['distinct4']:>7.2f}")
    for r in rows:
        if r["mean_width"] is not None and r["steps_by_kind"] != {"plain": sum(r["steps_by_kind"].values())}:
            print(f"  {r['config']}: mean width {r['mean_width']:.2f}, steps {r['steps_by_kind']}, "
                  f"tree rows accepted/proposed by source {r['sources']}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model path, GGUF, package:PKG/FILE or random:PRESET")
    ap.add_argument("--prompts", default=None, help="JSONL with `prompt` or `input_ids`; random prompts if absent")
    ap.add_argument("--chat", action="store_true", help="format each prompt as a user turn with the chat template")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="evenly spaced over the file; default: all (8 random prompts without --prompts)")
    ap.add_argument("--prompt-len", type=int, default=64, help="length of random prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--configs", default="3,2,2;4,3,3", help="semicolon-separated N,W,G")
    ap.add_argument("--pld", default="3,10", help="HF prompt-lookup draft lengths to run as peers ('' for none)")
    ap.add_argument("--no-plain", action="store_true", help="leave out our plain path (e.g. for an identity sweep)")
    ap.add_argument("--compiled", action="store_true",
                    help="add the HF compiled greedy peer (StaticCache + torch.compile'd decode step; compiled once, "
                         "compile time reported apart)")
    ap.add_argument("--peer-skip-guards", action="store_true",
                    help=f"with --compiled, also {SKIP_GUARDS_PEER}: the same peer without dynamo's guards on the "
                         "model, as our engine's compiled step runs")
    ap.add_argument("--engine-compile", choices=["off", "on"], default=None,
                    help="run our configurations on one long-lived engine (a replica's) with its decode forward "
                         "compiled (on) or eager (off); default: a fresh one-request engine per prompt, eager")
    ap.add_argument("--row-price", type=float, default=None,
                    help="with --engine-compile, pin the planner's price of one more row (in one-token steps) "
                         "instead of measuring it: 0 runs every proposed row, as where width is free (tokens per "
                         "step, not speed)")
    ap.add_argument("--compile-autotune", choices=["on", "off"], default="on",
                    help="on CPU, the HF compiled peer times inductor's C++ GEMM template against the library "
                         "kernels per layer (our engine's GEMMs read its one copy of the weights: nothing to tune)")
    ap.add_argument("--successor-prefill", choices=["on", "off"], default=None,
                    help="engine: record the top-k after every prompt token (default: EngineConfig's)")
    ap.add_argument("--pool", choices=["on", "off", "both"], default="on", help="n-grams from prompt and output")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--fp32-reference", action="store_true", help="also compare every output with HF greedy in float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sample (HF do_sample) instead of greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    vocab = model.config.get_text_config().vocab_size
    prompts = load_prompts(args.prompts, tokenizer, args.num_prompts, vocab, args.prompt_len, args.chat)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p) if args.temperature > 0 else None
    greedy = sampling is None
    configs = parse_configs(args.configs, args.pool, args.pld, not greedy, plain=not args.no_plain,
                            compiled=args.compiled, skip_guards=args.peer_skip_guards)
    reference_model = None
    if args.fp32_reference and greedy and model.dtype != torch.float32:
        reference_model, _ = load_model(args.model, dtype="float32", device=args.device)

    ours = [c.params for c in configs if c.kind in ("plain", "lookahead")]
    engine_config = None
    if args.engine_compile is not None and ours:
        la = [p for p in ours if p is not None] or [LookaheadParams()]
        widest = LookaheadParams(max(p.n for p in la), max(p.w for p in la), max(p.g for p in la),
                                 lookup=max(p.lookup for p in la), successors=max(p.successors for p in la))
        engine_config = EngineConfig(
            max_batch=1, max_seq_len=max(len(p) for p in prompts) + args.max_new_tokens,
            max_new_tokens=args.max_new_tokens, prefill_chunk=max(len(p) for p in prompts), shared_pool_cap=0,
            max_n=max(p.n for p in la), max_w=max(p.w for p in la), max_g=max(p.g for p in la),
            max_lookup=max(p.lookup for p in la), max_successors=max(p.successors for p in la), lookahead=la[0],
            compile=args.engine_compile, compile_max_width=widest.max_step_tokens, compile_prefill=False,
            row_price=args.row_price,  # as if rows cost this on any machine: tokens per step, not speed
            **({} if args.successor_prefill is None else {"successor_prefill": args.successor_prefill == "on"}))
    t_engine = time.perf_counter()
    if args.row_price is not None and engine_config is None:
        ap.error("--row-price needs --engine-compile (on or off): it pins the long-lived engine's planner")
    # our runner lays out its model's weights for its own kernels: the peers keep theirs as loaded
    ours_model = load_model(args.model, dtype=args.dtype, device=args.device)[0] if ours and configs != ours else None
    bench = Bench(model, configs, args.max_new_tokens, sampling, max(len(p) for p in prompts), engine_config,
                  args.compile_autotune == "on", ours_model)
    engine_compile_s = time.perf_counter() - t_engine
    compile_s = {name: peer.warm_up(prompts[0]) for name, peer in bench.compiled.items()}
    compiles = dict(torch._dynamo.utils.counters["frames"]).get("ok", 0)
    for config in configs:  # warm-up: first-call costs out of the figures
        bench.run(config, prompts[0])
    bench.reset()

    total, done, t_start = len(prompts) * len(configs), 0, time.perf_counter()
    for i, prompt in enumerate(prompts):
        bench.start_prompt()
        reference, _ = bench.run(configs[0], prompt)
        fp32 = None
        if reference_model is not None:
            fp32 = run_hf(reference_model, prompt, args.max_new_tokens)[0]
        elif args.fp32_reference and greedy:
            fp32 = reference  # the run is in float32 already
        bench.compare(configs[0], reference, reference, fp32)
        rest = configs[1:]
        k = i % len(rest) if rest else 0
        for config in rest[k:] + rest[:k]:
            tokens, _ = bench.run(config, prompt)
            bench.compare(config, tokens, reference, fp32)
        done += len(configs)
        elapsed = time.perf_counter() - t_start
        print(f"\r[{done}/{total}] {elapsed:.0f}s elapsed, ~{elapsed / done * (total - done):.0f}s left", end="", file=sys.stderr)
    print(file=sys.stderr)

    rows = report_rows(bench, greedy, args.fp32_reference)
    mode = "greedy" if greedy else f"sampling T={sampling.temperature} top_k={sampling.top_k} top_p={sampling.top_p}"
    dtype = str(model.dtype).removeprefix("torch.")
    cpu = torch.backends.cpu.get_cpu_capability()
    print_table(rows, f"model={args.model} dtype={dtype} prompts={len(prompts)} ({args.prompts or 'random'}"
                      f"{', chat' if args.chat else ''}) max_new_tokens={args.max_new_tokens} "
                      f"threads={torch.get_num_threads()} cpu={cpu} {mode}")
    compiled = None
    if bench.compiled:
        recompiles = dict(torch._dynamo.utils.counters["frames"]).get("ok", 0) - compiles
        compiled = {name: {"compile_s": compile_s[name], "static_cache_len": peer.max_cache_len, "recompiles": recompiles,
                           "freezing": peer.freezing, "inductor": peer.options} for name, peer in bench.compiled.items()}
        for name, peer in bench.compiled.items():
            print(f"{name}: decode step compiled once in {compile_s[name]:.1f}s (not in the figures), static cache "
                  f"{peer.max_cache_len} tokens")
        print(f"{recompiles} recompiles after warm-up (every compiled peer)")
    if bench.engine is not None and bench.engine.runner.graphs is not None:
        status = graph_status(bench.engine)
        eager = bench.engine.runner.eager_forwards
        print(f"our engine: graphs ready in {engine_compile_s:.1f}s (not in the figures); "
              f"{eager} decode forwards ran eagerly (outside every graph)")
        for b in status:
            print(f"  graph batch<={b['batch']} width<={b['width']} kv<={b['kv']}: compile {b['compile_s']}s "
                  f"(stored before: {b['cached']}), {b['calls']} forwards")
        print(f"  measured forward ms by batch and width: {bench.runner.costs.table()}")
        engine_report = {"buckets": status, "eager_forwards": eager, "compile_s": engine_compile_s,
                         "forward_ms": bench.runner.costs.table()}
    report = {
        "args": vars(args),
        "dtype": dtype,
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cpu_capability": cpu},
        "rows": rows,
    }
    if compiled is not None:
        report["hf_compiled"] = compiled
    if bench.engine is not None and bench.engine.runner.graphs is not None:
        report["engine_compiled"] = engine_report
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()

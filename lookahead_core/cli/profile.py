"""Measure a step-cost profile for the router: forward latency over (batch, tokens per row) through
the engine's buffers, and each (N, W, G) setting's compression decoded through the engine.

    python -m lookahead_core.cli.profile --prompts benchmarks/prompts/chat.jsonl --chat \\
        --out configs/profiles/smollm2-135m-cpu-bf16.yaml
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

from lookahead_core.engine.config import EngineConfig
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.policy.cost_profile import Setting, StepCostProfile


def _progress(done: int, total: int, start: float, what: str) -> None:
    el = time.perf_counter() - start
    print(f"\r[{'#' * int(30 * done / total):<30}] {done}/{total} {what:<28} ETA {el / max(done, 1) * (total - done):4.0f}s", end="", file=sys.stderr)


def measure_step_cost(engine, batch_sizes, tokens, repeats: int, progress) -> list[list[float]]:
    """Time decode forwards of `b` rows of `t` tokens over a committed prefix of 128 tokens."""
    import torch

    runner, cache, buf = engine.runner, engine.cache, engine.buffers
    lat = []
    for b in batch_sizes:
        row = []
        for t in tokens:
            for slot in range(b):
                cache.lengths[slot] = 128
                buf.reset_slot(slot, 128)
            tpl = torch.zeros((t, t), dtype=runner.dtype, device=runner.device)
            times = []
            for rep in range(repeats + 1):
                for slot in range(b):
                    buf.write_block(slot, 128, tpl, t)
                    buf.write_index[slot, :t] = buf.arange[:t] + 128
                    buf.pos[slot, :t] = buf.arange[:t] + 128
                    buf.ids[slot, :t] = (buf.arange[:t] * 7 + slot) % 100 + 1
                buf.to_device(b, t)
                cache.prepare_rows(b, buf.dev[2, :b, :t], 128 + t)
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    logits = runner.model(input_ids=buf.dev[0, :b, :t], position_ids=buf.dev[1, :b, :t],
                                          attention_mask=buf.mask[:b, :, :t, : 128 + t], past_key_values=cache, use_cache=True).logits
                    logits.argmax(-1).tolist()
                    dt = time.perf_counter() - t0
                if rep:
                    times.append(dt * 1000)
            row.append(round(statistics.median(times), 3))
            progress(f"step b={b} t={t}")
        lat.append(row)
    for slot in range(max(batch_sizes)):
        cache.lengths[slot] = 0
        buf.reset_slot(slot, 0)
    return lat


def measure_settings(runner, prompts, candidates, max_new: int, progress, shared_pool_cap: int = 0) -> list[Setting]:
    """Compression and mean step width of each setting over the prompts, decoded one after the
    other through the engine, as a replica decodes: with `shared_pool_cap`, each setting starts
    from an empty shared pool, which fills with the text of the prompts before."""
    from lookahead_core.engine.config import EngineConfig
    from lookahead_core.engine.engine import Engine
    from lookahead_core.engine.generation import default_eos

    eos = default_eos(runner)
    longest = max(len(p) for p in prompts)
    out = [Setting(n=None, compression=1.0, step_tokens=1.0)]
    for params in candidates:
        engine = Engine(runner, EngineConfig(
            max_batch=1, max_seq_len=longest + max_new, max_new_tokens=max_new, prefill_chunk=max(1, longest - 1),
            max_n=params.n, max_w=params.w, max_g=params.g, shared_pool_cap=shared_pool_cap))
        tokens = steps = width = 0
        for i, prompt in enumerate(prompts):
            engine.add_request(i, prompt, max_new_tokens=max_new, params=params, eos_token_id=eos)
            while engine.has_work():
                for done in (o for o in engine.step() if o.finish_reason is not None):
                    tokens += done.stats["new_tokens"]
                    steps += done.stats["steps"]
                    width += done.stats["planned_tokens"]
        out.append(Setting(n=params.n, w=params.w, g=params.g, compression=round(tokens / steps, 4), step_tokens=round(width / steps, 2)))
        progress(f"compression {out[-1].label}")
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from lookahead_core.cli.prompt_sets import read_prompt_set
    from lookahead_core.engine.engine import Engine
    from lookahead_core.engine.model_runner import ModelRunner
    from lookahead_core.models.loading import DEFAULT_MODEL, load_model

    ap = argparse.ArgumentParser(prog="python -m lookahead_core.cli.profile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", default="benchmarks/prompts/code.jsonl")
    ap.add_argument("--chat", action="store_true", help="send each prompt as a user turn through the chat template")
    ap.add_argument("--num-prompts", type=int, default=32, help="evenly spaced over the file")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    ap.add_argument("--tokens", default="1,4,8,16,32,64")
    ap.add_argument("--settings", default="3,4,4;4,5,5;4,7,7;5,7,7;3,2,2;4,3,3")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--shared-pool-cap", type=int, default=EngineConfig.model_fields["shared_pool_cap"].default,
                    help="the engine's shared_pool_cap the compression is measured with (0: no shared pool)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    runner = ModelRunner(model)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    tokens = [int(x) for x in args.tokens.split(",")]
    candidates = [LookaheadParams.parse(s) for s in args.settings.split(";") if s.strip()]
    prompts = read_prompt_set(args.prompts, tokenizer, args.num_prompts, args.chat)
    widest = max(tokens)
    engine = Engine(runner, EngineConfig(max_batch=max(batch_sizes), max_n=8, max_w=max(16, widest), max_g=16,
                                         max_new_tokens=args.max_new_tokens, shared_pool_cap=args.shared_pool_cap))
    if engine.config.max_step_tokens < widest:
        sys.exit(f"--tokens up to {widest} exceeds the engine's step width {engine.config.max_step_tokens}")
    total = len(batch_sizes) * len(tokens) + len(candidates)
    done, start = 0, time.perf_counter()

    def progress(what: str) -> None:
        nonlocal done
        done += 1
        _progress(done, total, start, what)

    lat = measure_step_cost(engine, batch_sizes, tokens, args.repeats, progress)
    settings = measure_settings(runner, prompts, candidates, args.max_new_tokens, progress, args.shared_pool_cap)
    print(file=sys.stderr)
    profile = StepCostProfile(
        model=args.model, device=args.device, dtype=str(model.dtype).removeprefix("torch."),
        machine=f"{platform.machine()} {platform.processor() or ''} torch {torch.__version__} threads={torch.get_num_threads()}".strip(),
        batch_sizes=batch_sizes, tokens=tokens, latency_ms=lat, settings=settings, shared_pool_cap=args.shared_pool_cap,
    )
    profile.save(args.out)
    print(f"wrote {args.out}")
    for s in settings:
        print(f"  {s.label:<10} compression {s.compression:.2f}, {s.step_tokens:.1f} tokens/row, "
              f"predicted single-request speedup {s.compression * profile.step_ms(1, 1) / profile.step_ms(1, s.step_tokens):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

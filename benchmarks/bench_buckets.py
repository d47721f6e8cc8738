"""What a one-token step of each batch costs in its compiled graph, by how its GEMMs were chosen.

    python -m benchmarks.bench_buckets --batches 1,2,4,8,16 --gemm rule,autotune,template

The served config's engine and core plan (torch threads), one bucket (batch, 1) at a time compiled
(or loaded from inductor's cache) before timing; `batch` requests of `--prompt-tokens` tokens
decode together and the median of `--steps` steps is the cost. The GEMM choice per graph:
`rule` is the engine's own (`Bucket.template_gemms`), `autotune` times inductor's C++ template
against the library kernels at every GEMM, `template` takes the template only.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import yaml

from deployments.config import AppArgs, resolve_path
from lookahead_core.engine.compiled_forward import CompiledForward
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.model_runner import ModelRunner
from lookahead_core.engine.request import EngineRequest
from lookahead_core.lookahead.stopping import StopCondition
from lookahead_core.models.loading import load_model

RULE = CompiledForward.options_for
CHOICES = {
    "rule": RULE,
    "autotune": lambda self, bucket: self.inductor_options,
    "template": lambda self, bucket: self.template_options,
}


def step_cost(model, cfg, batch: int, prompt_tokens: int, steps: int) -> dict:
    engine = Engine(ModelRunner(model), cfg.model_copy(update={
        "compile": "on", "compile_buckets": [[batch, 1]], "compile_prefill": False}))
    status = engine.compile_status()[0]
    vocab = model.config.vocab_size
    for i in range(batch):
        prompt = tuple((100 + i + j) % vocab for j in range(prompt_tokens))
        # enough new tokens that the first request still decodes once the last prompt is in
        engine.add_request(EngineRequest(f"r{i}", prompt, StopCondition.build(prompt_tokens + steps + 8, ()), "off"))
    graphs = engine.runner.graphs
    if graphs is None:
        raise SystemExit("the engine built no compiled graphs (compile needs a model that inductor can trace)")
    sched = engine.scheduler
    while sched.waiting or sched.prefilling is not None:  # every prompt in its slot
        engine.step()
    engine.step()  # the last prompt's first decode step
    calls, times = graphs.calls, []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1000)
    bucket = next(iter(graphs.ready))
    if len(sched.running) < batch:
        raise SystemExit(f"batch {batch}: requests finished while timing; raise the engine's max_new_tokens")
    return {"batch": batch, "step_ms": round(statistics.median(times), 2), "compiled_steps": graphs.calls - calls,
            "steps": steps, "gemm_backends": graphs.options_for(bucket).get("max_autotune_gemm_backends"),
            "compile_s": status["compile_s"], "cached": status["cached"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--gemm", default="rule,autotune,template", help="rule | autotune | template, in this order")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    gemms = args.gemm.split(",")
    if unknown := [g for g in gemms if g not in CHOICES]:
        ap.error(f"--gemm: unknown {unknown}; choose from {sorted(CHOICES)}")
    batches = [int(b) for b in args.batches.split(",")]
    with open(args.config) as f:
        app = AppArgs.model_validate(yaml.safe_load(f)["applications"][0]["args"])
    if max(batches) > app.engine.max_batch:
        ap.error(f"--batches: {max(batches)} exceeds engine.max_batch {app.engine.max_batch}")
    plan = app.core_plan().apply()
    m = app.model
    model, _ = load_model(resolve_path(m.path), gguf_file=m.gguf_file, dtype=m.dtype, device=m.device,
                          cache_dir=m.resolved_cache_dir())
    head = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "dtype": str(model.dtype).removeprefix("torch."),
            "torch_threads": plan["torch_threads"], "prompt_tokens": args.prompt_tokens}
    print(" ".join(f"{k} {v}" for k, v in head.items()), flush=True)
    rows = []
    for gemm in gemms:
        CompiledForward.options_for = CHOICES[gemm]  # type: ignore[method-assign]  # the experiment's one knob
        try:
            for batch in batches:
                row = {"gemm": gemm, **step_cost(model, app.engine, batch, args.prompt_tokens, args.steps)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                gc.collect()
        finally:
            CompiledForward.options_for = RULE  # type: ignore[method-assign]
    print(f"\none-token step, ms (median of {args.steps}; {head['dtype']}, {head['cpu_capability']}, "
          f"{head['torch_threads']} torch threads)")
    print("batch  " + "  ".join(f"{g:>9}" for g in gemms))
    for batch in batches:
        cells = {r["gemm"]: r["step_ms"] for r in rows if r["batch"] == batch}
        print(f"{batch:>5}  " + "  ".join(f"{cells[g]:>9.2f}" for g in gemms))
    report = {**head, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()

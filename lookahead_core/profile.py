"""A measured step-cost profile: forward latency against batch and tokens per row, and the
compression of candidate (N, W, G) settings.

    python -m lookahead_core.profile --model models/tiny-pycoder --prompts benchmarks/prompts/code.jsonl \\
        --out configs/profiles/tiny-pycoder-cpu.yaml
"""
from __future__ import annotations

import argparse
import bisect
import platform
import statistics
import sys
import time
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from .engine_config import EngineConfig
from .params import LookaheadParams
from .shared_pool import SharedNGramPool


class Setting(BaseModel):
    """A lookahead setting and what it was measured to give; n = None is plain decoding."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    n: int | None = None
    w: int = 0
    g: int = 0
    compression: float = Field(1.0, gt=0)
    step_tokens: float = Field(1.0, ge=1, description="mean tokens per row of a step (window + candidates found)")

    @property
    def params(self) -> LookaheadParams | None:
        return None if self.n is None else LookaheadParams(self.n, self.w, self.g)

    @property
    def max_step_tokens(self) -> int:
        return 1 if self.n is None else self.params.max_step_tokens

    @property
    def label(self) -> str:
        return "plain" if self.n is None else f"({self.n},{self.w},{self.g})"


class StepCostProfile(BaseModel):
    """latency_ms[i][j]: one decode forward of batch batch_sizes[i], every row tokens[j] wide."""

    model_config = ConfigDict(extra="forbid")
    model: str
    device: str
    dtype: str = "float32"
    machine: str = ""
    shared_pool_cap: int = Field(0, ge=0, description="the engine's shared pool the compression was measured with (0: none)")
    batch_sizes: list[int]
    tokens: list[int]
    latency_ms: list[list[float]]
    settings: list[Setting]
    _cost: list[list[float]] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _shape(self) -> StepCostProfile:
        if sorted(self.batch_sizes) != self.batch_sizes or sorted(self.tokens) != self.tokens:
            raise ValueError("batch_sizes and tokens must be increasing")
        if len(self.latency_ms) != len(self.batch_sizes) or any(len(r) != len(self.tokens) for r in self.latency_ms):
            raise ValueError("latency_ms must be len(batch_sizes) rows of len(tokens) values")
        if not any(s.n is None for s in self.settings):
            raise ValueError("settings must include plain decoding (n: null)")
        self._cost = self._monotone(self.latency_ms)
        return self

    @staticmethod
    def _monotone(lat: list[list[float]]) -> list[list[float]]:
        """Each cell lowered to the cheapest cell with at least its batch and tokens. Timing noise
        only adds time, so a cell dearer than a bigger step is noise, and left in it would tell the
        router that a small batch of plain steps costs more than it does."""
        rows, cols = len(lat), len(lat[0])
        cost = [row[:] for row in lat]
        for i in reversed(range(rows)):
            for j in reversed(range(cols)):
                if i + 1 < rows:
                    cost[i][j] = min(cost[i][j], cost[i + 1][j])
                if j + 1 < cols:
                    cost[i][j] = min(cost[i][j], cost[i][j + 1])
        return cost

    @classmethod
    def load(cls, path: str | Path) -> StepCostProfile:
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(yaml.safe_dump(self.model_dump(), sort_keys=False))

    def pool_mismatch(self, engine_shared_pool_cap: int) -> str | None:
        """A warning if the engine runs with(out) the shared pool this profile's compression was
        measured without (with): the router would then misjudge what lookahead gains."""
        if (self.shared_pool_cap > 0) == (engine_shared_pool_cap > 0):
            return None
        return (
            f"profile of {self.model} measured compression with shared_pool_cap={self.shared_pool_cap}, but the engine "
            f"runs with shared_pool_cap={engine_shared_pool_cap}; re-run python -m lookahead_core.profile "
            f"--shared-pool-cap {engine_shared_pool_cap}"
        )

    def step_ms(self, batch: int, tokens: float) -> float:
        """Bilinear interpolation in (batch, tokens) over the monotone grid, linear extrapolation
        beyond it."""

        def bracket(axis: list[int], x: float) -> tuple[int, int, float]:
            if len(axis) == 1:
                return 0, 0, 0.0
            i = min(max(bisect.bisect_right(axis, x) - 1, 0), len(axis) - 2)
            return i, i + 1, (x - axis[i]) / (axis[i + 1] - axis[i])

        i0, i1, fb = bracket(self.batch_sizes, batch)
        j0, j1, ft = bracket(self.tokens, tokens)
        lat = self._cost
        low = lat[i0][j0] + ft * (lat[i0][j1] - lat[i0][j0])
        high = lat[i1][j0] + ft * (lat[i1][j1] - lat[i1][j0])
        return max(low + fb * (high - low), 1e-3)


# ---- measurement --------------------------------------------------------------------------


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


def measure_settings(runner, prompts, candidates, max_new: int, progress, shared_pool: SharedNGramPool | None = None) -> list[Setting]:
    """Compression and mean step width of each setting over the prompts, decoded one after the
    other as a replica would: each setting starts from an empty shared pool, which fills with
    the text of the prompts before."""
    import torch

    from .generation import make_decoder

    out = [Setting(n=None, compression=1.0, step_tokens=1.0)]
    for params in candidates:
        if shared_pool is not None:
            shared_pool.clear()
        tokens = steps = width = 0
        for prompt in prompts:
            dec = make_decoder(runner, torch.tensor([prompt]), max_new_tokens=max_new, params=params, shared_pool=shared_pool)
            dec.prefill()
            while not dec.finished:
                dec.step()
            tokens += len(dec.new_tokens)
            steps += dec.steps
            width += dec.seq.planned_tokens
            if shared_pool is not None:
                shared_pool.add_text(dec.tokens)
        out.append(Setting(n=params.n, w=params.w, g=params.g, compression=round(tokens / steps, 4), step_tokens=round(width / steps, 2)))
        progress(f"compression {out[-1].label}")
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from .engine import Engine
    from .loading import load_model
    from .model_runner import ModelRunner
    from .prompt_sets import read_prompt_set

    ap = argparse.ArgumentParser(prog="python -m lookahead_core.profile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
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
    settings = measure_settings(runner, prompts, candidates, args.max_new_tokens, progress, engine.shared_pool)
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

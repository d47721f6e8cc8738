"""`generate` and `stream` for one sequence: the batching engine, run with one request."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.io import EngineRequest, SequenceStats
from lookahead_core.engine.runner.model_runner import ModelRunner
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams
from lookahead_core.lookahead.stopping import FinishReason, StopCondition


@dataclass
class GenerationStats(SequenceStats):
    """The request's own figures (steps by kind, accepted histogram, compression) and its timings."""

    forward_s: float = 0.0
    decode_s: float = 0.0

    @property
    def host_overhead(self) -> float:
        """Share of decode-step time spent outside the model forward."""
        return 1.0 - self.forward_s / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: FinishReason
    stats: GenerationStats


def _prompt_list(input_ids: torch.Tensor | Iterable[int]) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must have shape [1, T], got {list(input_ids.shape)}")
        return input_ids[0].tolist()
    return [int(t) for t in input_ids]


def single_request_engine(model: torch.nn.Module | ModelRunner, prompt_len: int, max_new_tokens: int,
                          params: LookaheadParams | None) -> Engine:
    """An engine with one slot sized for this request: the whole prompt in one prefill forward."""
    runner = model if isinstance(model, ModelRunner) else ModelRunner(model)
    runner.check_length(prompt_len + max_new_tokens)
    p = params or LookaheadParams(2, 1, 0, lookup=0)
    config = EngineConfig(max_batch=1, max_seq_len=max(2, prompt_len + max_new_tokens), max_new_tokens=max_new_tokens,
                          prefill_chunk=max(1, prompt_len), max_waiting=0, max_n=p.n, max_w=p.w, max_g=p.g,
                          max_lookup=p.lookup, max_successors=p.successors, lookahead=p, shared_pool_cap=0,
                          history_tokens=0)
    return Engine(runner, config)


def default_eos(runner: ModelRunner):
    """The model's `generation_config.eos_token_id`, as `model.generate` uses it."""
    config = runner.generation_config
    return getattr(config, "eos_token_id", None) if config is not None else None


def _start(model, input_ids, max_new_tokens, params, eos_token_id, stop_token_ids, sampling) -> Engine:
    runner = model if isinstance(model, ModelRunner) else ModelRunner(model)
    eos = default_eos(runner) if eos_token_id is None else eos_token_id
    req = EngineRequest(0, tuple(_prompt_list(input_ids)), StopCondition.build(max_new_tokens, eos, stop_token_ids),
                        params if params is not None else "off", sampling)
    engine = single_request_engine(runner, len(req.prompt), max_new_tokens, params)
    engine.add_request(req)
    return engine


def stream(model, input_ids, *, max_new_tokens: int, params: LookaheadParams | None = None,
           eos_token_id: int | Iterable[int] | None = None, stop_token_ids: Iterable[int] = (),
           sampling: SamplingParams | None = None) -> Iterator[list[int]]:
    """Yield the token ids accepted at each decode step."""
    engine = _start(model, input_ids, max_new_tokens, params, eos_token_id, stop_token_ids, sampling)
    while engine.has_work():
        for out in engine.step():
            if out.tokens:
                yield out.tokens


def generate(model, input_ids, *, max_new_tokens: int, params: LookaheadParams | None = None,
             eos_token_id: int | Iterable[int] | None = None, stop_token_ids: Iterable[int] = (),
             sampling: SamplingParams | None = None) -> GenerationResult:
    """Greedy decoding, with lookahead when `params` is given; token-identical either way.
    With `sampling` (SamplingParams, temperature > 0) it samples, and lookahead keeps the
    output distribution (and, with a seed, the very tokens).

    `eos_token_id=None` takes the model's `generation_config.eos_token_id`, as `model.generate`
    does; pass `[]` to decode to `max_new_tokens` regardless.
    """
    engine = _start(model, input_ids, max_new_tokens, params, eos_token_id, stop_token_ids, sampling)
    tokens: list[int] = []
    final = None
    while engine.has_work():
        for out in engine.step():
            tokens.extend(out.tokens)
            if out.finish_reason is not None:
                final = out
    # The engine ends every request, and its final output carries the stats.
    assert final is not None and final.finish_reason is not None and final.stats is not None
    stats = GenerationStats(**dataclasses.asdict(final.stats), forward_s=engine.forward_s,
                            decode_s=engine.step_s - engine.prefill_s)
    return GenerationResult(tokens=tokens, finish_reason=final.finish_reason, stats=stats)


def warm_up(engine: Engine, prompt: Iterable[int], max_new_tokens: int = 4) -> None:
    """Pay a fresh process's first (slow) forwards with one plain and one lookahead request, then
    forget their text: the replica's learned tables and stored prompt prefixes are as at start."""
    prompt = tuple(prompt)
    modes: tuple[Literal["off", "auto"], ...] = ("off", "auto")
    for i, lookahead in enumerate(modes):
        engine.add_request(EngineRequest(f"warm-up-{i}", prompt, StopCondition(max_new_tokens), lookahead))
        while engine.has_work():
            engine.step()
    engine.knowledge.clear()
    if engine.runner.prefixes is not None:
        engine.runner.prefixes.clear()

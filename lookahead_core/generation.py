"""Public entry points: `generate` and `stream` for one sequence."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from .decoder import SequenceDecoder
from .model_runner import ModelRunner
from .params import LookaheadParams
from .sampling import SamplingParams
from .shared_pool import SharedNGramPool
from .stopping import StopCondition


@dataclass
class GenerationStats:
    steps: int
    new_tokens: int
    accepted_histogram: dict[int, int] = field(default_factory=dict)
    forward_s: float = 0.0
    decode_s: float = 0.0

    @property
    def compression(self) -> float:
        """New tokens per decode step (1.0 for plain decoding)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def host_overhead(self) -> float:
        """Share of decode-step time spent outside the model forward."""
        return 1.0 - self.forward_s / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats


def _prompt_list(input_ids: torch.Tensor | Iterable[int]) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must have shape [1, T], got {list(input_ids.shape)}")
        return input_ids[0].tolist()
    return [int(t) for t in input_ids]


def _default_eos(runner: ModelRunner):
    config = runner.generation_config
    return getattr(config, "eos_token_id", None) if config is not None else None


def make_decoder(
    model: torch.nn.Module | ModelRunner,
    input_ids: torch.Tensor | Iterable[int],
    *,
    max_new_tokens: int,
    params: LookaheadParams | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    stop_token_ids: Iterable[int] = (),
    sampling: SamplingParams | None = None,
    shared_pool: SharedNGramPool | None = None,
) -> SequenceDecoder:
    runner = model if isinstance(model, ModelRunner) else ModelRunner(model)
    if params is not None and not isinstance(params, LookaheadParams):
        raise TypeError(f"params must be LookaheadParams or None, got {type(params).__name__}")
    eos = _default_eos(runner) if eos_token_id is None else eos_token_id
    stop = StopCondition.build(max_new_tokens, eos, stop_token_ids)
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be SamplingParams or None, got {type(sampling).__name__}")
    return SequenceDecoder(runner, _prompt_list(input_ids), params, stop, sampling, shared_pool)


def stream(model, input_ids, *, max_new_tokens: int, params: LookaheadParams | None = None, eos_token_id=None, stop_token_ids=(), sampling=None) -> Iterator[list[int]]:
    """Yield the token ids accepted at each decode step."""
    decoder = make_decoder(
        model, input_ids, max_new_tokens=max_new_tokens, params=params, eos_token_id=eos_token_id,
        stop_token_ids=stop_token_ids, sampling=sampling,
    )
    decoder.prefill()
    while not decoder.finished:
        yield decoder.step()


def generate(model, input_ids, *, max_new_tokens: int, params: LookaheadParams | None = None, eos_token_id=None, stop_token_ids=(), sampling=None) -> GenerationResult:
    """Greedy decoding, with lookahead when `params` is given; token-identical either way.
    With `sampling` (SamplingParams, temperature > 0) it samples, and lookahead keeps the
    output distribution.

    `eos_token_id=None` takes the model's `generation_config.eos_token_id`, as `model.generate`
    does; pass `[]` to decode to `max_new_tokens` regardless.
    """
    decoder = make_decoder(
        model, input_ids, max_new_tokens=max_new_tokens, params=params, eos_token_id=eos_token_id,
        stop_token_ids=stop_token_ids, sampling=sampling,
    )
    decoder.prefill()
    while not decoder.finished:
        decoder.step()
    stats = GenerationStats(
        steps=decoder.steps,
        new_tokens=len(decoder.new_tokens),
        accepted_histogram=dict(sorted(decoder.accepted_histogram.items())),
        forward_s=decoder.forward_s,
        decode_s=decoder.step_s,
    )
    return GenerationResult(tokens=decoder.new_tokens, finish_reason=decoder.finish_reason, stats=stats)

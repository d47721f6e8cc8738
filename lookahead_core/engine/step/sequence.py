"""One request in the engine: a record of its tokens, limits, sampling, slot, figures and drafter."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from lookahead_core.constraints.grammar import Grammars
from lookahead_core.constraints.shaping import RowShaper
from lookahead_core.engine.io import EngineRequest, SequenceStats
from lookahead_core.lookahead.drafter import Drafter
from lookahead_core.lookahead.knowledge import ReplicaKnowledge
from lookahead_core.lookahead.layout import StepLayout
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams, new_seed
from lookahead_core.lookahead.stopping import FinishReason, StopCondition


@dataclass(eq=False)  # the scheduler finds a sequence by identity
class Sequence:
    """The last accepted token is never in the KV cache: each step feeds it first. A sampled
    request draws output position p with the uniform u(seed, p), so its text is fixed by the seed up
    to rounding-level ties (lookahead/sampling.py); `sampling` holds the warp alone, so requests
    that warp alike draw together. `drafter` is None for plain decoding; `shaper` None where no
    option or grammar changes the model's logits."""

    seq_id: str | int
    tokens: list[int]
    prompt_len: int
    stop: StopCondition
    layout: StepLayout
    drafter: Drafter | None = None
    sampling: SamplingParams | None = None
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_lp: list | None = None  # prompt logprobs gathered while prefilling, sent on the first output
    slot: int | None = None  # the KV slot, owned by the scheduler
    finish_reason: FinishReason | None = None
    group: str | int | None = None  # the served request this is a choice of (EngineRequest.group)
    shaper: RowShaper | None = None
    stats: SequenceStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = SequenceStats(self.prompt_len)

    @classmethod
    def of(cls, req: EngineRequest, params: LookaheadParams | None,
           layout_for: Callable[[LookaheadParams | None], StepLayout],
           knowledge: ReplicaKnowledge | None = None, grammars: Grammars | None = None,
           vocab_size: int = 0) -> Sequence:
        """A new request's record, with its drafter where it runs lookahead (`params`) and its
        shaper where its options or grammar (a matcher from `grammars`) change the logits."""
        tokens = list(req.prompt)
        shaper = None
        if req.grammar is not None or (req.rules is not None and req.rules.active):
            if req.grammar is not None and grammars is None:
                raise ValueError("this engine has no tokenizer for grammars: it cannot constrain output")
            grammar = grammars.matcher(req.grammar) if req.grammar is not None and grammars is not None else None
            shaper = RowShaper(req.rules, grammar, tokens, req.stop.eos_ids | req.stop.stop_ids, vocab_size)
        warp = req.sampling if req.sampling is not None and not req.sampling.greedy else None
        seed = None if warp is None else warp.seed if warp.seed is not None else new_seed()
        layout = layout_for(params)
        drafter = None if params is None else Drafter(params, layout, tokens, warp is not None, knowledge)
        return cls(req.request_id, tokens, len(tokens), req.stop, layout, drafter,
                   None if warp is None else dataclasses.replace(warp, seed=None), seed,
                   req.logprobs, req.prompt_logprobs, [None] if req.prompt_logprobs is not None else None,
                   group=req.group, shaper=shaper)

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def produced(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def sampled(self) -> bool:
        """Drawn from a distribution (temperature > 0), not greedy."""
        return self.sampling is not None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

"""A decode step's outputs into each request's tokens: sampled walks drawn, rows accepted, the
accepted rows' keys and values moved behind the last token, one `StepOutput` per request."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lookahead_core.engine.kv_cache import BatchKVCache
from lookahead_core.engine.logprobs import TokenLogprob, token_logprobs
from lookahead_core.engine.sequence import Row, Sequence
from lookahead_core.engine.sequence_stats import SequenceStats
from lookahead_core.lookahead.pacing import StepKind
from lookahead_core.lookahead.sampling import SamplingParams, position_uniform, sample_rows
from lookahead_core.lookahead.stopping import FinishReason


@dataclass
class StepOutput:
    """One request's share of a step: the tokens it accepted, what kind of row it ran and how
    wide; on its last output the finish reason and the request's `SequenceStats`."""

    seq_id: str | int
    tokens: list[int]
    finish_reason: FinishReason | None = None
    kind: StepKind | None = None
    width: int = 0
    stats: SequenceStats | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first output; the first token has none
    sources: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # tree rows by `Source`: (proposed, accepted)


def verify(running: list[Sequence], rows: list[Row], pred: list[list[int]], logits: torch.Tensor,
           cache: BatchKVCache) -> list[StepOutput]:
    """Each running request accepts its tokens (`pred`: the argmax of every row; sampled requests
    walk their drawn tokens); its slot's length grows by them."""
    lengths = cache.lengths
    drawn = draw_walks(running, rows, logits)
    outputs: list[StepOutput] = []
    slots: list[int] = []
    src: list[int] = []
    dst: list[int] = []
    for b, (seq, row) in enumerate(zip(running, rows)):
        accepted_rows, accepted = seq.accept(pred[b], row, drawn.get(b))
        start = lengths[b]
        if accepted_rows:  # the accepted candidate's rows move right behind the last token
            slots.extend([b] * len(accepted_rows))
            src.extend(start + r for r in accepted_rows)
            dst.extend(range(start + 1, start + 1 + len(accepted_rows)))
        lengths[b] = start + len(accepted)
        out = StepOutput(seq.seq_id, accepted, seq.finish_reason, row.choice.kind, row.width,
                         seq.stats if seq.finished else None, sources=seq.step_sources)
        if seq.logprobs is not None:
            out.logprobs = token_logprobs(logits[b], [0, *accepted_rows], accepted, seq.logprobs)
        if seq.prompt_lp is not None:
            out.prompt_logprobs, seq.prompt_lp = seq.prompt_lp, None
        outputs.append(out)
    if slots:
        cache.move_entries(slots, src, dst)
    return outputs


def draw_walks(running: list[Sequence], rows: list[Row], logits: torch.Tensor) -> dict[int, dict[int, int]]:
    """Sampled requests' tokens along their walks: {batch row: {step row: token}}. Level by
    level, each request's next row is drawn for all of them at once per sampling setting (one
    transfer each); a row is drawn only once the walk reaches it, as plain sampling would."""
    sampled = [b for b, seq in enumerate(running) if seq.sampled]
    drawn: dict[int, dict[int, int]] = {b: {} for b in sampled}
    todo = [(b, 0, first_draw(running[b])) for b in sampled]
    while todo:
        groups: dict[SamplingParams, list[tuple[int, int, float]]] = {}
        for b, at, u in todo:  # one group per warp (`Sequence.sampling` holds no seed)
            warp = running[b].sampling
            assert warp is not None
            groups.setdefault(warp, []).append((b, at, u))
        todo = []
        for params, members in groups.items():
            index_b = torch.tensor([b for b, _, _ in members], device=logits.device)
            index_t = torch.tensor([at for _, at, _ in members], device=logits.device)
            tokens = sample_rows(logits[index_b, index_t], params, [u for _, _, u in members])
            for (b, at, _), token in zip(members, tokens):
                drawn[b][at] = token
                if (nxt := next_draw(running[b], rows[b], at, token)) is not None:
                    todo.append((b, *nxt))
    return drawn


def first_draw(seq: Sequence) -> float:
    """The uniform of a sampled request's first token this step (step row 0)."""
    assert seq.seed is not None, "first_draw() is for sampled requests, which all have a seed"
    return position_uniform(seq.seed, len(seq.tokens) - seq.prompt_len)


def next_draw(seq: Sequence, row: Row, at: int, token: int) -> tuple[int, float] | None:
    """A sampled request's walk, one drawn token at a time: given `token` drawn at step row
    `at` (0 first: the last token's row), the step row whose token the walk needs next (the
    tree child holding `token`) and its uniform, from its output position; None where the
    walk ends. Rows off the walk are never drawn, so a rejected candidate costs no sampling."""
    assert seq.seed is not None, "next_draw() is for sampled requests, which all have a seed"
    tree = seq.tree
    node = 0 if at == 0 else at - row.cand_start + 1
    child = tree.child(node, token)
    if child is None:
        return None
    produced = len(seq.tokens) - seq.prompt_len
    return row.cand_start + child - 1, position_uniform(seq.seed, produced + int(tree.depth[child - 1]))

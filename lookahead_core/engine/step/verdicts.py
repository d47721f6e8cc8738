"""A step's outputs into each request's verdict and tokens: sampled walks drawn, the step rows whose
keys and values stay, what the step taught, one `StepOutput` per request; a prefill's first token."""
from __future__ import annotations

import numpy as np
import torch

from lookahead_core.engine.io import StepOutput, token_logprobs
from lookahead_core.engine.step.planner import StepPlan
from lookahead_core.engine.step.scheduler import PrefillJob
from lookahead_core.engine.step.sequence import Sequence
from lookahead_core.lookahead.drafter import Draft, Span, plain_span
from lookahead_core.lookahead.knowledge import ReplicaKnowledge
from lookahead_core.lookahead.sampling import SamplingParams, position_uniform, sample_rows
from lookahead_core.lookahead.verify import verify


def verify_step(plan: StepPlan, pred: list[list[int]], logits: torch.Tensor) -> tuple[list[StepOutput], list[list[int]]]:
    """Each running request takes its verdict (`pred`: the argmax of every step row; sampled
    requests walk their drawn tokens); returns the outputs and, per request, the step rows whose
    keys and values stay (the runner's `commit` moves them behind the last token)."""
    drawn = draw_walks(plan, logits)
    outputs: list[StepOutput] = []
    kept: list[list[int]] = []
    for b, (seq, draft, span) in enumerate(zip(plan.seqs, plan.drafts, plan.spans)):
        out, kv_rows = settle(seq, draft, span, pred[b], drawn.get(b), logits[b])
        outputs.append(out)
        kept.append(kv_rows)
    return outputs, kept


def prefilled(job: PrefillJob, logits: torch.Tensor, knowledge: ReplicaKnowledge, observed: bool) -> StepOutput | None:
    """What a prompt chunk's logits (`logits` [1, T', V]) say: the prompt tokens' logprobs where
    asked, and for the chunk that completes the prompt its first new token (`first_token`). The
    successors table learns the chunk's tokens' successors where every row came back (`observed`),
    else the last prompt token's, as a decode step records them."""
    seq, start, n = job.seq, job.start, job.tokens
    succ = knowledge.successors
    if observed and succ is not None:
        knowledge.observe_prefill(np.asarray(seq.tokens[start : start + n]),
                                  logits[0].topk(succ.k, dim=-1).indices.cpu().numpy())
    if seq.prompt_logprobs is not None and seq.prompt_lp is not None:  # row i predicts prompt token start + i + 1
        rows = min(n, seq.prompt_len - 1 - start)
        seq.prompt_lp += token_logprobs(logits[0], range(rows), seq.tokens[start + 1 : start + rows + 1],
                                        seq.prompt_logprobs)
    if not job.last:
        return None
    last = logits[0, -1:]
    pred = last.argmax(dim=-1, keepdim=True)  # [1, 1]
    if succ is not None and not observed:  # with the argmax in one transfer, as a decode step
        pred = torch.cat([pred, last.topk(succ.k, dim=-1).indices], dim=-1)
    tokens = pred.cpu().numpy()
    if succ is not None and not observed:
        knowledge.observe_prefill(np.asarray(seq.tokens[-1:]), tokens[:, 1:])
    return first_token(seq, last, int(tokens[0, 0]))


def first_token(seq: Sequence, logits: torch.Tensor, greedy: int) -> StepOutput:
    """A prompt's first new token, from the prefill's last row (`logits` [1, V], `greedy` its
    argmax): that token, or for a sampled request the draw at output position 0; a one-token step,
    so the first token waits for no decode forward."""
    drawn = None
    if seq.shaper is not None:
        drawn = {0: pick(seq, logits[0], first_draw(seq) if seq.sampled else 0.0)}
    elif seq.sampling is not None:
        drawn = {0: sample_rows(logits, seq.sampling, [first_draw(seq)])[0]}
    out, _ = settle(seq, None, plain_span(seq.layout), [greedy], drawn, logits)
    return out


def settle(seq: Sequence, draft: Draft | None, span: Span, pred: list[int], drawn: dict[int, int] | None,
           logits: torch.Tensor) -> tuple[StepOutput, list[int]]:
    """One request's verdict on its span (`logits` [T, V]: its step rows'): its tokens, finish
    reason and figures grow by it and its drafter learns from it; returns its output and the step
    rows whose keys and values stay."""
    verdict = verify(draft.tree if draft is not None else None, span.cand_start, pred, seq.stop, seq.produced, drawn)
    if seq.shaper is not None and drawn is not None:  # the walk's tokens past a stop rule's cut
        seq.shaper.rollback(len(drawn) - len(verdict.tokens))
    seq.tokens.extend(verdict.tokens)
    seq.finish_reason = verdict.finish_reason
    if seq.drafter is not None:
        seq.drafter.learn(span, verdict, pred, seq.tokens)
    seq.stats.record(span.choice.kind, span.width, len(verdict.tokens))
    if verdict.sources is not None:
        seq.stats.record_sources(*verdict.sources)
    out = StepOutput(seq.seq_id, verdict.tokens, seq.finish_reason, span.choice.kind, span.width,
                     seq.stats if seq.finished else None)
    if seq.logprobs is not None:
        out.logprobs = token_logprobs(logits, [0, *verdict.kv_rows], verdict.tokens, seq.logprobs)
    if seq.prompt_lp is not None:
        out.prompt_logprobs, seq.prompt_lp = seq.prompt_lp, None
    return out, verdict.kv_rows


def draw_walks(plan: StepPlan, logits: torch.Tensor) -> dict[int, dict[int, int]]:
    """The tokens along the walks of sampled requests and of requests whose logits are shaped
    (options, a grammar): {batch row: {step row: token}}. Level by level, each request's next row
    is drawn (or, shaped and greedy, its argmax taken) once the walk reaches it, as plain decoding
    would: unshaped sampled rows at once per sampling setting (one transfer each), shaped rows one
    by one with the state their path reached."""
    running = plan.seqs
    walking = [b for b, seq in enumerate(running) if seq.sampled or seq.shaper is not None]
    drawn: dict[int, dict[int, int]] = {b: {} for b in walking}
    todo = [(b, 0, first_draw(running[b]) if running[b].sampled else 0.0) for b in walking]
    while todo:
        groups: dict[SamplingParams, list[tuple[int, int, float]]] = {}
        picked: list[tuple[int, int, int]] = []
        for b, at, u in todo:  # one group per warp (`Sequence.sampling` holds no seed)
            seq = running[b]
            if seq.shaper is not None:
                picked.append((b, at, pick(seq, logits[b, at], u)))
            else:
                assert seq.sampling is not None
                groups.setdefault(seq.sampling, []).append((b, at, u))
        for params, members in groups.items():
            index_b = torch.tensor([b for b, _, _ in members], device=logits.device)
            index_t = torch.tensor([at for _, at, _ in members], device=logits.device)
            tokens = sample_rows(logits[index_b, index_t], params, [u for _, _, u in members])
            picked += [(b, at, token) for (b, at, _), token in zip(members, tokens)]
        todo = []
        for b, at, token in picked:
            drawn[b][at] = token
            if (nxt := next_draw(running[b], plan.drafts[b], plan.spans[b], at, token)) is not None:
                todo.append((b, *nxt))
    return drawn


def pick(seq: Sequence, row: torch.Tensor, u: float) -> int:
    """A shaped request's next token from its logits `row` [V]: shaped by its options and grammar,
    then the argmax, or for a sampled request the draw at uniform `u`; its shaper takes the token."""
    shaper = seq.shaper
    assert shaper is not None
    token = shaper.argmax(row) if seq.sampling is None else sample_rows(shaper.shape(row).unsqueeze(0), seq.sampling, [u])[0]
    return shaper.advance(token)


def first_draw(seq: Sequence) -> float:
    """The uniform of a sampled request's first token this step (step row 0)."""
    assert seq.seed is not None, "first_draw() is for sampled requests, which all have a seed"
    return position_uniform(seq.seed, seq.produced)


def next_draw(seq: Sequence, draft: Draft | None, span: Span, at: int, token: int) -> tuple[int, float] | None:
    """A walk, one token at a time: given `token` taken at step row `at` (0 first: the last
    token's row), the step row whose token the walk needs next (the tree child holding `token`)
    and, for a sampled request, its uniform from its output position (else 0); None where the
    walk ends. Rows off the walk are never drawn, so a rejected candidate costs no sampling."""
    if draft is None:
        return None
    tree = draft.tree
    node = 0 if at == 0 else at - span.cand_start + 1
    child = tree.child(node, token)
    if child is None:
        return None
    u = position_uniform(seq.seed, seq.produced + int(tree.depth[child - 1])) if seq.seed is not None else 0.0
    return span.cand_start + child - 1, u

"""Shared test fixtures: random prompts, the Hugging Face greedy reference, a tokenizer of characters."""
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from lookahead_core.engine.io import EngineRequest
from lookahead_core.lookahead.stopping import StopCondition


def random_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts of 1..~60 tokens; a few repeat a segment so the prompt pool gets hits."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 4, 6, 9, 12, 17, 24, 30, 40, 48, 7, 10]
    prompts = []
    for i in range(count):
        length = lengths[i % len(lengths)]
        toks = torch.randint(2, vocab, (length,), generator=gen).tolist()
        if i % 5 == 4:
            toks = toks + toks[: max(1, length // 2)] + toks
        prompts.append(toks)
    return prompts


NO_EOS = {"eos_token_id": None}


def hf_greedy(model, prompt: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """`model.generate` greedy; pass **NO_EOS to decode to the length limit (an explicit None
    eos_token_id overrides the model's generation config)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **generate_kwargs
    )
    return out[0, len(prompt) :].tolist()


def longest_cycle_free_ratio(tokens: list[int]) -> float:
    """Share of distinct tokens; a greedy output stuck in a short loop scores low."""
    return len(set(tokens)) / max(1, len(tokens))


def min_top2_margin(model, prompt: list[int], continuation: list[int]) -> float:
    """Smallest gap between the two best logits along the greedy path (teacher-forced).

    Below ~1e-4 in float32 the argmax is a tie within rounding, and any change in the order of
    floating-point sums (another prefill split, another batch shape) may flip it.
    """
    seq = torch.tensor([prompt + continuation], device=model.device)
    with torch.no_grad():
        logits = model(seq).logits[0, len(prompt) - 1 : len(prompt) + len(continuation) - 1]
    top2 = logits.topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


def well_conditioned_cases(model, count: int, vocab: int, seed: int, max_new_tokens: int, margin: float = 1e-4):
    """`count` (prompt, HF greedy reference) pairs whose greedy path has no rounding-level tie."""
    cases, skipped = [], 0
    for prompt in random_prompts(count * 2, vocab, seed):
        ref = hf_greedy(model, prompt, max_new_tokens, **NO_EOS)
        if min_top2_margin(model, prompt, ref) < margin:
            skipped += 1
            continue
        cases.append((prompt, ref))
        if len(cases) == count:
            break
    assert len(cases) == count and skipped <= count // 4, f"too many near-tie prompts: {skipped}"
    return cases


def run_to_end(engine, requests) -> dict:
    """Add `requests` to `engine` and step it until none is left: {request id: tokens}."""
    out = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        for o in engine.step():
            out[o.seq_id] += o.tokens
    return out


def req(request_id, prompt, max_new_tokens: int, params=None, eos=(), **kwargs) -> EngineRequest:
    """An EngineRequest: `params` None is plain decoding ("off"); `eos` ids end it early."""
    return EngineRequest(request_id, tuple(prompt), StopCondition.build(max_new_tokens, eos),
                         params if params is not None else "off", **kwargs)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (its code), "\\n" (10), "<unk>" (0) and "</s>" (1, the
    end): the tiny models' tokenizer (vocabulary 128)."""
    vocab = {chr(i): i for i in range(32, 127)}
    vocab.update({"<unk>": 0, "</s>": 1, "\n": 10})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")

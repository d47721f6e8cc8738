"""Train the embedded default model: a small Llama on permissively licensed Python source.

    python -m tools.train_default_model --out models/tiny-pycoder        # ~55 min on 2 CPU cores

Stages: collect the corpus (tools/corpus.py), hold out whole files, train a byte-level BPE
tokenizer, tokenize, train with bf16 autocast, save float32 safetensors + tokenizer + manifests.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tools.corpus import collect

EOS = "<|endoftext|>"


def progress(done: int, total: int, start: float, extra: str = "") -> None:
    elapsed = time.perf_counter() - start
    eta = elapsed / max(done, 1) * (total - done)
    bar = "#" * int(30 * done / total)
    print(f"\r[{bar:<30}] {done}/{total} {elapsed / 60:5.1f} min, ETA {eta / 60:5.1f} min {extra}", end="", file=sys.stderr, flush=True)


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS, bos_token=EOS, unk_token=EOS, pad_token=EOS)
    tok.model_max_length = 1024
    return tok


def encode(tok, texts: list[str]) -> np.ndarray:
    eos = tok.convert_tokens_to_ids(EOS)
    out = []
    for i in range(0, len(texts), 256):
        for ids in tok(texts[i : i + 256])["input_ids"]:
            out.extend(ids)
            out.append(eos)
    return np.asarray(out, dtype=np.uint16)


def build_model(vocab_size: int, eos_id: int, args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@torch.no_grad()
def perplexity(model, data: np.ndarray, seq: int, max_chunks: int = 64) -> float:
    model.eval()
    n = min(max_chunks, (len(data) - 1) // seq)
    losses = []
    for i in range(n):
        x = torch.from_numpy(data[i * seq : (i + 1) * seq].astype(np.int64))[None]
        losses.append(model(input_ids=x, labels=x).loss.item())
    model.train()
    return math.exp(sum(losses) / len(losses))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/tiny-pycoder")
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--heldout", type=float, default=0.04, help="share of files held out")
    ap.add_argument("--max-mb-per-origin", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model and fuse AdamW: ~20%% faster steps on this CPU (needs a C++ compiler); "
                    "the shipped model was trained without it")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    files, manifest = collect(args.max_mb_per_origin)
    train_files = [f for f in files if not f.held_out(args.heldout)]
    held_files = [f for f in files if f.held_out(args.heldout)]
    print(f"corpus: {len(files)} files ({sum(len(f.text) for f in files) / 1e6:.1f} MB), "
          f"{len(held_files)} held out; {time.perf_counter() - t0:.0f}s", file=sys.stderr)

    # A 30 MB sample is plenty for 8k merges and keeps tokenizer training to a minute.
    sample, size = [], 0
    for f in random.Random(args.seed).sample(train_files, len(train_files)):
        if size > 30e6:
            break
        sample.append(f.text)
        size += len(f.text)
    tok = train_tokenizer(sample, args.vocab)
    train_ids = encode(tok, [f.text for f in train_files])
    held_ids = encode(tok, [f.text for f in held_files])
    print(f"tokenizer + encoding: {len(train_ids) / 1e6:.1f}M train tokens, {len(held_ids) / 1e6:.2f}M held out; "
          f"{time.perf_counter() - t0:.0f}s", file=sys.stderr)

    eos_id = tok.convert_tokens_to_ids(EOS)
    model = build_model(len(tok), eos_id, args)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), fused=args.compile)
    forward = torch.compile(model) if args.compile else model

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = np.random.default_rng(args.seed)
    log, start, ema = [], time.perf_counter(), None
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        starts = gen.integers(0, len(train_ids) - args.seq - 1, size=args.batch)
        x = torch.from_numpy(np.stack([train_ids[s : s + args.seq] for s in starts]).astype(np.int64))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 10 == 0 or step == args.steps - 1:
            progress(step + 1, args.steps, start, f"loss {ema:.3f}")
        if (step + 1) % 500 == 0 or step == args.steps - 1:
            log.append({"step": step + 1, "train_loss_ema": round(ema, 4), "minutes": round((time.perf_counter() - start) / 60, 2)})
    print(file=sys.stderr)

    model.eval()
    ppl = perplexity(model, held_ids, args.seq)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "corpus.json").write_text(json.dumps({
        "sources": manifest,
        "heldout_share": args.heldout,
        "train_tokens_available": int(len(train_ids)),
        "heldout_tokens": int(len(held_ids)),
        "heldout_files": [f.key for f in held_files],
    }, indent=1))
    (out / "training.json").write_text(json.dumps({
        "args": vars(args),
        "parameters": params,
        "tokens_seen": args.steps * args.batch * args.seq,
        "minutes": round((time.perf_counter() - start) / 60, 1),
        "heldout_perplexity": round(ppl, 3),
        "log": log,
        "torch": torch.__version__,
    }, indent=1))
    print(f"saved to {out}: {params / 1e6:.1f}M parameters, held-out perplexity {ppl:.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()

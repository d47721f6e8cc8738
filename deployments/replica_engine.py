"""A replica's engine, built where it will step: in a process of its own (`EngineProcess`, the
default) or on a thread of the replica. `build_engine` is the one recipe for both."""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from lookahead_core.constraints.grammar import Grammars, grammar_tokenizer
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.generation import warm_up
from lookahead_core.engine.runner.memory_plan import free_memory
from lookahead_core.engine.runner.model_runner import ModelRunner
from lookahead_core.models.loading import dtype_reason, load_model

from .config import AppArgs, resolve_path

log = logging.getLogger("ray.serve")


def build_engine(args: AppArgs, warm_prompt: list[int]) -> tuple[Engine, dict[str, Any]]:
    """Apply the core plan to this process, load the model, build the engine and warm it up (a
    fresh process's first forwards are many times slower than the next: they are paid here, before
    Serve sends the replica a request). Returns the engine and what the replica reports of it."""
    plan = args.core_plan()
    core_plan = plan.apply()
    m = args.model
    model, tokenizer = load_model(resolve_path(m.path), gguf_file=m.gguf_file, dtype=m.dtype, device=m.device,
                          attn_implementation=m.attn_implementation, trust_remote_code=m.trust_remote_code,
                          cache_dir=m.resolved_cache_dir(), chat_template=m.chat_template)
    dtype = str(model.dtype).removeprefix("torch.")
    log.warning("serving %s: dtype %s (asked: %s%s), device %s, %d torch threads", m.served_name, dtype,
                m.dtype, dtype_reason(m.dtype, m.device), m.device, torch.get_num_threads())
    cfg = args.engine
    runner = ModelRunner(model, max_layouts=cfg.layout_cache, threads=plan.step_threads(), weight_layout=cfg.weight_layout)
    # a random model has no tokenizer: its requests cannot name a grammar
    grammars = Grammars(grammar_tokenizer(tokenizer, runner.vocab_size), runner.vocab_size) if tokenizer is not None else None
    engine = Engine(runner, cfg, free_bytes=free_memory(model.device), grammars=grammars)
    log.warning("%s; max_seq_len %d", engine.kv_plan.describe(), engine.max_seq_len)
    start = time.time()
    warm_up(engine, warm_prompt)
    log.warning("warm-up: %.1f s", time.time() - start)
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    return engine, {
        "dtype": dtype,
        "vocab_size": engine.runner.vocab_size,
        "eos_token_ids": [] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        "torch_threads": torch.get_num_threads(),
        "core_plan": core_plan,
    }

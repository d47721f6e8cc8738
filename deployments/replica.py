"""Model replicas: a thin Ray wrapper that owns the model, the engine thread and the metrics; each
request runs through lookahead_core.serving.RequestProcessor."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator

import torch
from ray import serve
from ray.serve import metrics

from lookahead_core.engine.async_engine import AsyncEngine
from lookahead_core.engine.engine import Engine
from lookahead_core.engine.generation import warm_up
from lookahead_core.engine.kv_budget import free_memory
from lookahead_core.engine.model_runner import ModelRunner
from lookahead_core.models.loading import cpu_capability, dtype_reason, load_model
from lookahead_core.serving import Completion, Delta, RequestError, RequestProcessor, ServeRequest
from lookahead_core.serving.outputs import REPLICA_TEXT_SOURCES

from .autoscaling import RUNNING, WAITING
from .config import AppArgs, resolve_path

log = logging.getLogger("ray.serve")


def _rss_mb() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def _step_time(engine) -> dict:
    """Mean milliseconds per engine step: in decode forwards, in prefill forwards, and on the host
    (planning, masks, verification: the rest of the step), over the replica's life."""
    steps = max(engine.steps, 1)
    host = engine.step_s - engine.forward_s - engine.prefill_s
    return {"steps": engine.steps, "forward": round(1000 * engine.forward_s / steps, 3),
            "prefill": round(1000 * engine.prefill_s / steps, 3), "host": round(1000 * host / steps, 3)}


# A dead replica is noticed within ~2 s and replaced (Serve's default checks every 10 s).
@serve.deployment(name="LookaheadModel", max_ongoing_requests=64, health_check_period_s=2, health_check_timeout_s=10)
class LookaheadModel:
    def __init__(self, args: dict) -> None:
        self.started = time.time()
        self.args = AppArgs.model_validate(args)
        self.core_plan = self.args.core_plan().apply()
        m = self.args.model
        model, tokenizer = load_model(resolve_path(m.path), gguf_file=m.gguf_file, dtype=m.dtype, device=m.device,
                                      attn_implementation=m.attn_implementation, trust_remote_code=m.trust_remote_code,
                                      cache_dir=m.resolved_cache_dir(), chat_template=m.chat_template)
        self.dtype = str(model.dtype).removeprefix("torch.")
        log.warning("serving %s: dtype %s (asked: %s%s), device %s, %d torch threads", m.served_name, self.dtype,
                    m.dtype, dtype_reason(m.dtype, m.device), m.device, torch.get_num_threads())
        if tokenizer is None:
            raise ValueError(f"model {m.path!r} has no tokenizer")
        cfg = self.args.engine
        self.engine = Engine(ModelRunner(model, max_layouts=cfg.layout_cache), cfg, free_bytes=free_memory(model.device))
        log.warning("%s; max_seq_len %d", self.engine.kv_plan.describe(), self.engine.max_seq_len)
        log.warning("warm-up: %.1f s", self._warm_up(tokenizer))
        self.async_engine = AsyncEngine(self.engine)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        max_prompt = self.engine.max_seq_len - 1
        limits = self.args.limits
        self.processor = RequestProcessor(
            tokenizer,
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else eos,
            limits=limits.model_copy(update={"max_prompt_tokens": min(limits.max_prompt_tokens or max_prompt, max_prompt)}),
            model_name=m.served_name,
        )
        self._metrics()

    def _warm_up(self, tokenizer) -> float:
        """A fresh process's first forwards are many times slower than the next: pay them here,
        before Serve sends this replica any request."""
        start = time.time()
        warm_up(self.engine, tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"])
        return time.time() - start

    def _metrics(self) -> None:
        tags = ("lookahead",)  # the request's mode: auto, off or fixed
        self.m_compression = metrics.Histogram("lookahead_compression", "tokens per decode step, per request",
                                               boundaries=[1, 1.25, 1.5, 2, 2.5, 3, 4, 6], tag_keys=tags)
        self.m_accepted = metrics.Histogram("lookahead_accepted_tokens_per_step", "tokens accepted in one step",
                                            boundaries=[1, 2, 3, 4, 5, 6, 8], tag_keys=tags)
        self.m_ttft = metrics.Histogram("lookahead_ttft_ms", "time to first token",
                                        boundaries=[10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000])
        self.m_tpot = metrics.Histogram("lookahead_tpot_ms", "time per output token after the first",
                                        boundaries=[1, 2, 5, 10, 20, 50, 100, 250])
        self.m_running = metrics.Gauge("lookahead_running_requests", "sequences decoding on this replica")
        self.m_waiting = metrics.Gauge("lookahead_waiting_requests", "sequences queued on this replica")
        self.m_steps = metrics.Counter("lookahead_steps", "decode steps of finished requests, by the kind each row ran",
                                       tag_keys=("kind",))
        self.m_candidate_rows = metrics.Counter(
            "lookahead_candidate_rows", "verification tree rows of finished requests, by candidate source and outcome "
            "(proposed: run in a step; accepted)", tag_keys=("source", "outcome"))  # type: ignore[arg-type]
        self.m_width = metrics.Histogram("lookahead_step_width", "a request's mean step rows fed to the model",
                                         boundaries=[1, 2, 4, 8, 16, 32, 64], tag_keys=tags)

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; an engine that cannot step (its thread
        gone, or its last steps all raised) gets the replica replaced."""
        error = self.async_engine.health_error()
        if error is not None:
            raise RuntimeError(error)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What deployments.autoscaling.engine_queue_policy sizes the deployment by."""
        running, waiting = self.async_engine.queue_depth()
        return {RUNNING: running, WAITING: waiting}

    def info(self) -> dict:
        running, waiting = self.async_engine.queue_depth()
        engine = self.engine
        error = self.async_engine.health_error()
        return {
            "status": "ok" if error is None else "failing",
            **({"error": error} if error is not None else {}),
            "model": self.args.model.served_name,
            "dtype": self.dtype,
            # what a request's seed holds fixed: float32 logits do not depend on the step's shape
            "seeded_text": "fixed by the seed" if self.dtype == "float32" else
                           "fixed by the seed for the same step shapes only (lookahead widths, batch, compiled or eager)",
            "vocab_size": engine.runner.vocab_size,
            "device": self.args.model.device,
            "cpu_capability": cpu_capability(),
            "torch_threads": torch.get_num_threads(),
            "core_plan": self.core_plan,
            "running": running,
            "waiting": waiting,
            "replica": {"pid": os.getpid(), "started_at": round(self.started, 3), "rss_mb": _rss_mb(),
                        "engine_steps": engine.steps, "aborted_requests": engine.aborted},
            "kv_cache": {**engine.kv_plan.as_dict(), "max_seq_len": engine.max_seq_len},
            "auto_lookahead": engine.config.lookahead.label,
            "history": engine.knowledge.status(),
            "prefix_cache": None if engine.prefixes is None else engine.prefixes.status(),
            "step_costs_ms": engine.runner.costs.table(),
            "step_time_ms": _step_time(engine),
            "compiled_decode": {"mode": engine.config.compile, "buckets": engine.compile_status(),
                                "eager_forwards": engine.runner.eager_forwards if engine.compiled else None,
                                "graph_failures": engine.compiled.graph_failures if engine.compiled else None},
        }

    async def generate(self, req: ServeRequest) -> AsyncIterator[Delta | Completion | RequestError]:
        """Stream a Delta per engine step, then the Completion; a refused or failed request ends
        with its RequestError (the only item when it is refused before its first token)."""
        try:
            async for item in self.processor.run(req, self.async_engine):
                if isinstance(item, Delta) and item.token_ids:
                    self.m_accepted.observe(len(item.token_ids), tags={"lookahead": req.mode})
                elif isinstance(item, Completion):
                    self._observe(item)
                    if not self.args.report_replica_sources:
                        item = item.without_sources(REPLICA_TEXT_SOURCES)
                yield item
        except RequestError as err:
            yield err

    def _observe(self, c: Completion) -> None:
        n_tok = c.usage.completion_tokens
        if c.lookahead.compression is not None:
            self.m_compression.observe(c.lookahead.compression, tags={"lookahead": c.lookahead.mode})
        self.m_ttft.observe(c.timings.ttft_ms)
        if n_tok > 1:  # a timed-out request has tokens and timings but no engine figures (steps 0)
            self.m_tpot.observe((c.timings.total_ms - c.timings.ttft_ms) / (n_tok - 1))
        running, waiting = self.async_engine.queue_depth()
        self.m_running.set(running)
        self.m_waiting.set(waiting)
        for kind, steps in c.lookahead.steps_by_kind.items():
            self.m_steps.inc(steps, tags={"kind": kind})
        for source, counts in c.lookahead.sources.items():
            for outcome, rows in counts.items():
                if rows:
                    self.m_candidate_rows.inc(rows, tags={"source": source, "outcome": outcome})
        if c.lookahead.mean_width is not None:
            self.m_width.observe(c.lookahead.mean_width, tags={"lookahead": c.lookahead.mode})

    def __del__(self) -> None:
        engine = getattr(self, "async_engine", None)
        if engine is not None:
            engine.shutdown()

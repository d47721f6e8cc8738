"""Model replicas: a thin Ray wrapper that owns the model, the engine thread, the (N, W, G) router
and the metrics; each request runs through lookahead_core.serving.RequestProcessor."""
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
from lookahead_core.engine.model_runner import ModelRunner
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.models.loading import load_model
from lookahead_core.policy.auto import AutoLookahead
from lookahead_core.policy.controller import LookaheadPolicy
from lookahead_core.serving import Completion, Delta, RequestError, RequestProcessor, ServeRequest, ServingLimits

from .autoscaling import RUNNING, WAITING
from .config import PROJECT_ROOT, AppArgs, resolve_path

log = logging.getLogger("ray.serve")


def _rss_mb() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


# A dead replica is noticed within ~2 s and replaced (Serve's default checks every 10 s).
@serve.deployment(name="LookaheadModel", max_ongoing_requests=64, health_check_period_s=2, health_check_timeout_s=10)
class LookaheadModel:
    def __init__(self, args: dict) -> None:
        self.started = time.time()
        self.args = AppArgs.model_validate(args)
        torch.set_num_threads(self.args.threads)
        m = self.args.model
        model, tokenizer = load_model(resolve_path(m.path), gguf_file=m.gguf_file, dtype=m.dtype, device=m.device,
                                      attn_implementation=m.attn_implementation, trust_remote_code=m.trust_remote_code,
                                      cache_dir=m.resolved_cache_dir(), chat_template=m.chat_template)
        self.dtype = str(model.dtype).removeprefix("torch.")
        log.warning("serving %s: dtype %s (asked: %s), device %s, %d torch threads", m.served_name, self.dtype,
                    m.dtype, m.device, torch.get_num_threads())
        if tokenizer is None:
            raise ValueError(f"model {m.path!r} has no tokenizer")
        self.engine = Engine(ModelRunner(model), self.args.engine)
        router_cfg = self.args.router.model_copy(update={"max_batch": self.args.engine.max_batch})
        self.auto = AutoLookahead(LookaheadPolicy(router_cfg, base_dir=PROJECT_ROOT, costs=self.engine.runner.costs))
        profile = self.auto.router.profile
        if profile is not None and (mismatch := profile.pool_mismatch(self.args.engine.shared_pool_cap)):
            log.warning(mismatch)
        log.warning("warm-up: %.1f s", self._warm_up(tokenizer))
        self.async_engine = AsyncEngine(self.engine, before_step=self.auto.before_step)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        limits = self.args.limits
        max_prompt = self.engine.max_seq_len - 1
        self.processor = RequestProcessor(
            tokenizer,
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else eos,
            limits=ServingLimits(max_prompt_tokens=min(limits.max_prompt_tokens or max_prompt, max_prompt),
                                 max_stop_strings=limits.max_stop_strings, max_stop_chars=limits.max_stop_chars,
                                 request_timeout_s=limits.request_timeout_s),
            model_name=m.served_name,
        )
        self._metrics()

    def _warm_up(self, tokenizer) -> float:
        """A fresh process's first forwards are slow (SmolLM2 on one CPU thread: a first request's
        TTFT 4 s, then 0.2 s): pay them here, before Serve sends this replica any request."""
        start = time.time()
        prompt = tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
        for i, params in enumerate((None, LookaheadParams())):
            self.engine.add_request(f"warm-up-{i}", prompt, max_new_tokens=4, params=params)
            while self.engine.has_work():
                self.engine.step()
        if self.engine.shared_pool is not None:
            self.engine.shared_pool.clear()  # the warm-up text is no one's
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
        self.m_n = metrics.Gauge("lookahead_router_n", "N chosen by the router (0 = plain)")
        self.m_w = metrics.Gauge("lookahead_router_w", "W chosen by the router")
        self.m_g = metrics.Gauge("lookahead_router_g", "G chosen by the router")

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; a dead engine thread gets the replica replaced."""
        if not self.async_engine.alive:
            raise RuntimeError("the engine thread is not running")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What deployments.autoscaling.engine_queue_policy sizes the deployment by."""
        running, waiting = self.async_engine.queue_depth()
        return {RUNNING: running, WAITING: waiting}

    def info(self) -> dict:
        running, waiting = self.async_engine.queue_depth()
        cur = self.auto.current
        engine = self.engine
        return {
            "model": self.args.model.served_name,
            "dtype": self.dtype,
            "device": self.args.model.device,
            "torch_threads": torch.get_num_threads(),
            "running": running,
            "waiting": waiting,
            "replica": {"pid": os.getpid(), "started_at": round(self.started, 3), "rss_mb": _rss_mb(),
                        "engine_steps": engine.steps, "aborted_requests": engine.aborted},
            "router": {"policy": self.args.router.policy, "current": None if cur is None else [cur.n, cur.w, cur.g],
                       "steps_by_choice": self.auto.choice_counts(), "cost_scale": round(self.auto.router.cost_scale, 3)},
            "step_costs_ms": engine.runner.costs.table(),
        }

    async def generate(self, req: ServeRequest) -> AsyncIterator[Delta | Completion | RequestError]:
        """Stream a Delta per engine step, then the Completion; a refused or failed request ends
        with its RequestError (the only item when it is refused before its first token)."""
        try:
            async for item in self.processor.run(req, self.async_engine, self.auto):
                if isinstance(item, Delta) and item.token_ids:
                    self.m_accepted.observe(len(item.token_ids), tags={"lookahead": req.mode})
                elif isinstance(item, Completion):
                    self._observe(item)
                yield item
        except RequestError as err:
            yield err

    def _observe(self, c: Completion) -> None:
        steps, n_tok = c.lookahead.steps, c.usage.completion_tokens
        if c.lookahead.compression is not None:
            self.m_compression.observe(c.lookahead.compression, tags={"lookahead": c.lookahead.mode})
        self.m_ttft.observe(c.timings.ttft_ms)
        if n_tok > 1 and steps:
            self.m_tpot.observe((c.timings.total_ms - c.timings.ttft_ms) / (n_tok - 1))
        running, waiting = self.async_engine.queue_depth()
        self.m_running.set(running)
        self.m_waiting.set(waiting)
        cur = self.auto.current
        self.m_n.set(cur.n if cur else 0)
        self.m_w.set(cur.w if cur else 0)
        self.m_g.set(cur.g if cur else 0)

    def __del__(self) -> None:
        engine = getattr(self, "async_engine", None)
        if engine is not None:
            engine.shutdown()

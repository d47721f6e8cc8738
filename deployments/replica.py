"""Model replicas: a thin Ray wrapper that owns the model, the engine and the metrics; each request
runs through lookahead_core.serving.RequestProcessor. `LookaheadServer` is the same replica serving
the HTTP routes itself (`http_routes: model`): Serve's proxy sends requests straight to it, one hop
and one process fewer per request and per streamed chunk than through the separate ingress."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from fastapi import FastAPI
from ray import serve
from ray.serve import metrics

from lookahead_core.engine.host.async_engine import AsyncEngine
from lookahead_core.engine.host.engine_process import EngineProcess
from lookahead_core.engine.host.status import health_status, rss_mb
from lookahead_core.models.loading import cpu_capability, load_tokenizer, model_folder
from lookahead_core.serving import Completion, Delta, RequestError, RequestProcessor, ServeRequest
from lookahead_core.serving.outputs import REPLICA_TEXT_SOURCES

from .autoscaling import RUNNING, WAITING
from .bounded_bodies import bounded_bodies
from .config import AppArgs, resolve_path
from .replica_engine import build_engine
from .routes import Routes, api_app, guard_config

log = logging.getLogger("ray.serve")

# vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py), named as vLLM names them on
# Ray (vllm/v1/metrics/ray_wrappers.py: ":" becomes "_", OpenTelemetry's instrument names, which Ray
# exports through, having none), so Prometheus reads `ray_vllm_spec_decode_num_drafts_total` ... as
# from a vLLM replica under Ray Serve.
# A draft is a step that verified a candidate tree, its tokens the tree's rows, accepted the rows on
# the accepted path; per position: accepted rows by depth (0: the first after the step's last token).
SPEC_DECODE = "vllm_spec_decode_num_"
SPEC_DECODE_TAGS = ("model_name", "engine")
DRAFT_STEP_KINDS = ("verify", "full")  # StepKind names: the steps that carry a candidate tree


def spec_decode_counter(name: str, description: str, *tags: str) -> metrics.Counter:
    return metrics.Counter(SPEC_DECODE + name, description, tag_keys=(*SPEC_DECODE_TAGS, *tags))  # type: ignore[arg-type]


class ModelReplica:
    def __init__(self, args: dict) -> None:
        self.started = time.time()
        self.args = AppArgs.model_validate(args)
        m = self.args.model
        if m.path.startswith("random:"):
            raise ValueError(f"model {m.path!r} has no tokenizer: the server needs one")
        tokenizer = load_tokenizer(model_folder(resolve_path(m.path), m.gguf_file, m.resolved_cache_dir()),
                                   trust_remote_code=m.trust_remote_code, chat_template=m.chat_template)
        build = functools.partial(build_engine, self.args,
                                  tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"])
        if self.args.engine_process:
            host = EngineProcess(build)
            self.async_engine, self.facts = AsyncEngine(host), host.facts
        else:
            engine, self.facts = build()
            self.async_engine = AsyncEngine(engine)
        self.facts["core_plan"] = {**self.facts["core_plan"], **self.args.core_plan().apply_http()}
        limits = self.args.limits
        max_prompt = self.async_engine.limits.max_seq_len - 1
        self.processor = RequestProcessor(
            tokenizer,
            eos_token_ids=self.facts["eos_token_ids"],
            limits=limits.model_copy(update={"max_prompt_tokens": min(limits.max_prompt_tokens or max_prompt, max_prompt)}),
            model_name=m.served_name,
            vocab_size=self.facts["vocab_size"],
        )
        try:
            self.processor.prepare_grammars()
        except ValueError as exc:  # requests with a grammar are refused, naming their field
            log.warning("no grammars for %s: %s", m.served_name, exc)
        self._metrics()

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
        self.spec_tags = {"model_name": self.args.model.served_name, "engine": "0"}  # one engine per replica
        self.m_drafts = spec_decode_counter("drafts", "Number of spec decoding drafts: decode steps of finished requests "
                                            "that verified a candidate tree.")
        self.m_draft_tokens = spec_decode_counter("draft_tokens", "Number of draft tokens: candidate tree rows those steps "
                                                  "verified.")
        self.m_accepted_tokens = spec_decode_counter("accepted_tokens", "Number of accepted tokens: candidate tree rows on "
                                                     "the accepted paths.")
        self.m_accepted_per_pos = spec_decode_counter("accepted_tokens_per_pos", "Accepted tokens per draft position: by "
                                                      "depth in the candidate tree, from 0.", "position")

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

    async def info(self, detail: bool = True) -> dict:
        """/health: the status ("ok", "degraded" while a graph is missing and its steps run eagerly,
        "failing"), with the replica's figures where `detail` (an operator's call). The engine's
        part is its last status read (`AsyncEngine.status`), so probes cannot add to its steps."""
        error = self.async_engine.health_error()
        engine: dict = {}
        if self.async_engine.alive:
            with contextlib.suppress(RuntimeError, TimeoutError):  # stopped meanwhile (the error says why), or no read yet
                engine = await self.async_engine.status()
        status = health_status(error, engine)
        if not detail:
            return {"status": status}
        running, waiting = self.async_engine.queue_depth()
        dtype = self.facts["dtype"]
        process = engine.get("engine", {})
        own = process.get("pid") != os.getpid()
        rss = rss_mb()
        return {
            "status": status,
            **({"error": error} if error is not None else {}),
            **({"degraded": "compiled graphs failed; their steps run eagerly"} if status == "degraded" else {}),
            "model": self.args.model.served_name,
            "dtype": dtype,
            # float32 logits agree across step shapes to rounding, so a seed fixes the text but where a near-tie flips
            "seeded_text": "fixed by the seed, up to rounding-level ties" if dtype == "float32" else
                           "fixed by the seed for the same step shapes only (lookahead widths, batch, compiled or eager)",
            "vocab_size": self.facts["vocab_size"],
            "device": self.args.model.device,
            "cpu_capability": cpu_capability(),
            "torch_threads": self.facts["torch_threads"],
            "core_plan": self.facts["core_plan"],
            "running": running,
            "waiting": waiting,
            # rss_mb: the replica's memory, its engine process's included
            "replica": {"pid": os.getpid(), "started_at": round(self.started, 3),
                        "rss_mb": (rss or 0) + (process.get("rss_mb") or 0) if own else rss,
                        "engine_rss_mb": process.get("rss_mb"),
                        "engine": self.async_engine.host.kind, "engine_pid": process.get("pid"),
                        "engine_steps": process.get("steps"), "aborted_requests": process.get("aborted_requests")},
            **{k: v for k, v in engine.items() if k != "engine"},
        }

    async def generate(self, req: ServeRequest) -> AsyncGenerator[Delta | Completion | RequestError, None]:
        """Stream a Delta per engine step, then the Completion; a refused or failed request ends
        with its RequestError (the only item when it is refused before its first token)."""
        depths: list[int] = []  # accepted tree rows at each depth over the steps not yet counted
        try:
            async for item in self.processor.run(req, self.async_engine):
                if isinstance(item, Delta) and item.token_ids:
                    self._observe_step(len(item.token_ids), req.mode, depths)
                elif isinstance(item, Completion):
                    self._observe(item, depths)
                    depths = []
                    if not self.args.report_replica_sources:
                        item = item.without_sources(REPLICA_TEXT_SOURCES)
                yield item
        except RequestError as err:
            yield err

    def _observe_step(self, tokens: int, mode: str, depths: list[int]) -> None:
        """One engine step's tokens: all but the last were tree rows, accepted at depths 0, 1, ...
        (added to `depths`, counted with the request's other figures when it ends)."""
        self.m_accepted.observe(tokens, tags={"lookahead": mode})
        depths.extend([0] * (tokens - 1 - len(depths)))
        for depth in range(tokens - 1):
            depths[depth] += 1

    def _observe(self, c: Completion, depths: Sequence[int] = ()) -> None:
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
        spec = ((self.m_drafts, sum(c.lookahead.steps_by_kind.get(k, 0) for k in DRAFT_STEP_KINDS)),
                (self.m_draft_tokens, sum(v.get("proposed", 0) for v in c.lookahead.sources.values())),
                (self.m_accepted_tokens, sum(v.get("accepted", 0) for v in c.lookahead.sources.values())))
        for counter, n in spec:
            if n:  # Ray's counters refuse 0
                counter.inc(n, tags=self.spec_tags)
        for depth, n in enumerate(depths):
            if n:
                self.m_accepted_per_pos.inc(n, tags={**self.spec_tags, "position": str(depth)})

    def __del__(self) -> None:
        engine = getattr(self, "async_engine", None)
        if engine is not None:
            engine.shutdown()


class RoutedModelReplica(ModelReplica):
    """A model replica that also serves the routes; `guard` as the separate ingress would take it."""

    def __init__(self, args: dict, guard: dict | None = None) -> None:
        super().__init__(args)
        self.routes = Routes(self._open, self.info, self.args.model.served_name)
        self.guard = guard_config(guard)

    async def _open(self, req: ServeRequest) -> AsyncIterator[Delta | Completion | RequestError]:
        """Start a generation on this replica; raises the RequestError of a request refused before
        its first item. Closing the items (the client gone) closes the generation, which aborts it."""
        items = self.generate(req)
        first = await items.__anext__()
        if isinstance(first, RequestError):
            await items.aclose()
            raise first
        return _chained(first, items)

    async def __serve_build_asgi_app__(self) -> FastAPI:
        bodies = bounded_bodies(self.routes.model_name, self.facts["vocab_size"], self.args.engine, self.args.limits)
        return api_app(self.routes, bodies, self.guard)


async def _chained(first, rest: AsyncGenerator) -> AsyncIterator:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


def _deployment(cls: type):
    """A dead replica is noticed at the next health check (every 2 s, not Serve's 10) and replaced. Both
    kinds carry the one deployment name, so a config's `deployments:` entry fits either."""
    return serve.deployment(name="LookaheadModel", max_ongoing_requests=64, health_check_period_s=2,
                            health_check_timeout_s=10)(cls)


LookaheadModel = _deployment(ModelReplica)
LookaheadServer = _deployment(serve.ingress()(RoutedModelReplica))

"""Model replicas: each holds the model, the batching engine and the router."""
from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import AsyncIterator

import torch
from jinja2 import TemplateError
from ray import serve
from ray.serve import metrics

from lookahead_core.async_engine import AsyncEngine, RequestTimeout
from lookahead_core.auto_lookahead import AutoLookahead
from lookahead_core.engine import Engine, EngineOverloaded
from lookahead_core.loading import load_model
from lookahead_core.model_runner import ModelRunner
from lookahead_core.params import LookaheadParams
from lookahead_core.router import Router
from lookahead_core.sampling import SamplingParams

from .config import PROJECT_ROOT, AppArgs, resolve_path
from .text_stream import TextStream

log = logging.getLogger("ray.serve")


def _error(status: int, message: str) -> dict:
    return {"error": {"status": status, "message": message}}


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
        self.tokenizer = tokenizer
        self.engine = Engine(ModelRunner(model), self.args.engine)
        router_cfg = self.args.router.model_copy(update={"max_batch": self.args.engine.max_batch})
        self.auto = AutoLookahead(Router(router_cfg, base_dir=PROJECT_ROOT))
        profile = self.auto.router.profile
        if profile is not None and (mismatch := profile.pool_mismatch(self.args.engine.shared_pool_cap)):
            log.warning(mismatch)
        self.async_engine = AsyncEngine(self.engine, before_step=self.auto.before_step)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        self.eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.max_prompt_tokens = min(self.args.limits.max_prompt_tokens or self.engine.max_seq_len - 1,
                                     self.engine.max_seq_len - 1)
        tags = ("lookahead",)
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
                       "steps_by_choice": dict(self.auto.choices)},
        }

    def _params(self, lookahead) -> LookaheadParams | None:
        if lookahead in (None, "off"):
            return None
        return LookaheadParams(lookahead["n"], lookahead["w"], lookahead["g"])

    def _prompt(self, request: dict) -> list[int] | dict:
        limits = self.args.limits
        stops = request.get("stop") or []
        if len(stops) > limits.max_stop_strings or any(not s or len(s) > limits.max_stop_chars for s in stops):
            return _error(400, f"`stop` takes at most {limits.max_stop_strings} non-empty strings of at most "
                               f"{limits.max_stop_chars} characters")
        if request.get("input_ids") is not None:
            ids = [int(t) for t in request["input_ids"]]
        elif request.get("messages") is not None:
            if not self.tokenizer.chat_template:
                return _error(400, f"model {self.args.model.served_name!r} has no chat template: send `prompt` "
                                   "instead, or set model.chat_template in the server config")
            try:
                ids = self.tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True,
                                                         tokenize=True, return_dict=False)
            except TemplateError as exc:  # templates raise on conversations they refuse
                return _error(400, f"the model's chat template refused these messages: {exc}")
        else:
            ids = self.tokenizer(request["prompt"])["input_ids"]
            if not ids:
                return _error(400, "the prompt tokenizes to nothing")
        if len(ids) > self.max_prompt_tokens:
            return _error(400, f"the prompt has {len(ids)} tokens; this server accepts at most {self.max_prompt_tokens}")
        return ids

    def _timeout(self, request: dict) -> float | None:
        """The request's own timeout_s, capped by the server's request_timeout_s."""
        limits = [t for t in (request.get("timeout_s"), self.args.limits.request_timeout_s) if t is not None]
        return min(limits) if limits else None

    async def generate(self, request: dict) -> AsyncIterator[dict]:
        """Stream one dict per engine step, {"token_ids", "text"}, then a summary with "done".
        A refused request yields a single {"error": {"status", "message"}}."""
        t0 = time.perf_counter()
        prompt_ids = self._prompt(request)
        if isinstance(prompt_ids, dict):
            yield prompt_ids
            return
        lookahead = request.get("lookahead", "auto")
        auto = lookahead == "auto"
        seq_id = request.get("request_id") or uuid.uuid4().hex
        try:
            sampling = SamplingParams(request.get("temperature") or 0.0, request.get("top_k", 0), request.get("top_p", 1.0), request.get("seed"))
            params = self.auto.register(seq_id) if auto else self._params(lookahead)
        except ValueError as exc:
            yield _error(400, str(exc))
            return
        timeout_s = self._timeout(request)
        eos = [] if request.get("ignore_eos") else self.eos  # ignore_eos: decode on to max_new_tokens
        stream = self.async_engine.generate(prompt_ids, max_new_tokens=request["max_new_tokens"], params=params,
                                            eos_token_id=eos, request_id=seq_id, sampling=sampling, timeout_s=timeout_s)
        text = TextStream(self.tokenizer, request.get("stop") or [])
        tokens: list[int] = []
        steps, ttft, finish = 0, None, "length"
        try:
            async for out in stream:
                if out.tokens:
                    steps += 1
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    tokens.extend(out.tokens)
                    self.m_accepted.observe(len(out.tokens), tags={"lookahead": "auto" if auto else str(lookahead != "off")})
                    delta, hit = text.push(out.tokens)
                    yield {"token_ids": out.tokens, "text": delta}
                    if hit:
                        finish = "stop"
                        break
                if out.finish_reason is not None:
                    finish = out.finish_reason
                    break
        except EngineOverloaded as exc:
            yield _error(503, f"replica overloaded: {exc}")
            return
        except (ValueError, TypeError) as exc:
            yield _error(400, str(exc))
            return
        except RequestTimeout:
            if not tokens:  # nothing produced: an error, not an empty success
                # The client's own deadline is a 408; the server's ceiling is a 504.
                own = request.get("timeout_s") is not None and request["timeout_s"] <= timeout_s
                status, whose = (408, "its timeout_s") if own else (504, "the server's request_timeout_s")
                yield _error(status, f"request timed out after {timeout_s:g} s ({whose}) before its first token")
                return
            finish = "timeout"
        except RuntimeError as exc:  # the engine step failed; the engine has already started clean
            log.error("request %s failed: %s", seq_id, exc)
            yield _error(500, f"generation failed: {exc}")
            return
        finally:
            await stream.aclose()
            self.auto.forget(seq_id)
        tail = text.flush()
        if tail:
            yield {"token_ids": [], "text": tail}
        total = time.perf_counter() - t0
        chosen = self.auto.current if auto else params
        mode = "auto" if auto else ("off" if params is None else "fixed")
        summary = {
            "done": True,
            "text": text.text,
            "token_ids": tokens,
            "finish_reason": {"eos": "eos", "stop": "stop", "timeout": "timeout"}.get(finish, "length"),
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(tokens)},
            "lookahead": {"mode": mode, "n": chosen.n if chosen else None, "w": chosen.w if chosen else None,
                          "g": chosen.g if chosen else None, "steps": steps,
                          "compression": round(len(tokens) / steps, 3) if steps else None},
            "timings": {"ttft_ms": round(1000 * (ttft if ttft is not None else total), 2), "total_ms": round(1000 * total, 2)},
        }
        self._observe(summary, mode, total, ttft)
        yield summary

    def _observe(self, summary: dict, mode: str, total: float, ttft: float | None) -> None:
        steps, n_tok = summary["lookahead"]["steps"], summary["usage"]["completion_tokens"]
        if steps:
            self.m_compression.observe(n_tok / steps, tags={"lookahead": mode})
        self.m_ttft.observe(summary["timings"]["ttft_ms"])
        if n_tok > 1 and ttft is not None:
            self.m_tpot.observe((total - ttft) * 1000 / (n_tok - 1))
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

"""Limits of the batching engine, validated once and passed in."""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lookahead_core.lookahead.params import LookaheadParams

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(value: str | float | int) -> float | int:
    """"512MiB" / "2GB" / 1048576 -> bytes (int); a float in (0, 1] -> that fraction of free memory."""
    if isinstance(value, bool):
        raise ValueError(f"expected bytes (\"512MiB\") or a fraction in (0, 1], got {value!r}")
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"a fraction of free memory must be in (0, 1], got {value}")
        return value
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"a memory size must be >= 1 byte, got {value}")
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"memory must look like \"512MiB\", \"2GB\" or a fraction such as 0.8, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# a prefill_chunk^2 mask is allocated at start: 8192 is 128 MiB in bfloat16, 256 MiB in float32
MAX_PREFILL_CHUNK = 8192


class EngineConfig(BaseModel):
    """Sizes every buffer of the engine up front (KV slots x capacity, step rows, masks) and holds
    what the step planner needs: the "auto" lookahead setting, the TPOT cap, the cost prior."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch: int = Field(16, ge=1, le=512, description="most sequences decoded together (KV slots); the KV budget may allow fewer")
    max_seq_len: int | None = Field(None, ge=2, description="prompt + new tokens; default: the model's context length")
    kv_cache_memory: str | float | int | None = Field(
        None, description="KV cache budget: bytes (\"512MiB\", \"2GB\") or a fraction of the memory free at start "
                          "(0.9); the replica fits as many sequences of max_seq_len as it holds, up to max_batch. "
                          "None: max_batch slots whatever they take")
    max_new_tokens: int = Field(512, ge=1, description="largest max_new_tokens a request may ask for")
    prefill_chunk: int = Field(
        128, ge=1, description=f"prompt tokens prefilled per engine step, across prompts, one forward each (a chunk x "
                               f"chunk mask is allocated at start): at most {MAX_PREFILL_CHUNK}, or max_seq_len; longer "
                               f"than max_seq_len is never used")
    max_waiting: int = Field(1024, ge=0, description="requests queued beyond the running ones")
    request_slots: int | None = Field(
        None, ge=1, description="most KV slots the choices of one request (n > 1) hold at once; its other choices wait "
                                "behind other requests. None: half the slots")
    max_n: int = Field(8, ge=2)
    max_w: int = Field(16, ge=1)
    max_g: int = Field(16, ge=0)
    max_lookup: int = Field(16, ge=0, description="longest prompt-lookup candidate a request may ask for")
    max_successors: int = Field(32, ge=0, description="most successor-tree rows a request may ask for")
    lookahead: LookaheadParams = Field(LookaheadParams(), description="(N, W, G) of requests that ask for lookahead \"auto\"")
    slo_tpot_ms: float | None = Field(
        None, gt=0, description="time per output token a step may not exceed by widening: a cap on step width")
    row_price: float | None = Field(
        None, ge=0, description="pin the price of one more step row, in one-token steps, instead of measuring it: "
                                "tokens per step then do not depend on the machine (benchmarks of acceptance)")
    cost_prior_slope: float = Field(
        0.05, ge=0, description="before forwards are measured, a step of w tokens is priced 1 + slope x (w - 1) one-token steps")
    shared_pool_cap: int = Field(
        8, ge=0, description="continuations per token in the replica's shared n-gram pool of finished requests' text; 0 turns it off"
    )
    shared_pool_keys: int = Field(16384, ge=1, description="first tokens kept per n-gram size in the shared pool")
    shared_pool_text: int = Field(
        512, ge=2, description="tokens at the end of a finished request (prompt tail and output) added to the shared "
                               "pool and the history"
    )
    history_tokens: int = Field(
        65536, ge=0, description="tokens of finished requests' text the replica keeps and searches for the longest "
                                 "match of a request's suffix when its own text has none; 0 turns it off, else >= 2")
    successor_topk: int = Field(
        8, ge=0, le=64, description="successors kept per token in the replica's table of the model's top-k after each "
                                    "token it computed (vocab x k int32); 0 turns the table and successor trees off")
    successor_prefill: bool = Field(
        False, description="also record the top-k after every prompt token: logits for every prefill row, a dearer "
                           "prefill; on chat prompts it did not raise acceptance (docs/BENCHMARKS.md)")
    prefix_cache_tokens: int = Field(
        512, ge=0, description="tokens of prompt prefixes whose keys and values are kept and copied into a new "
                               "request's slot where its prompt starts with one (a chat template's system prompt, a "
                               "conversation's earlier turns): the prefill skips them; counted in the KV budget; 0 "
                               "turns it off")
    layout_cache: int = Field(32, ge=1, description="step layouts kept, one per (N, W, G, lookup, successors) in use")
    compile: Literal["off", "on", "auto"] = Field(
        "off", description="the decode forward compiled: \"on\" makes every graph ready before the engine starts, "
                           "\"auto\" serves at once (eager) and makes them ready in the background; graphs kept on "
                           "disk load in seconds, the others compile in worker processes")
    compile_max_width: int = Field(
        64, ge=1, description="on CPU, the widest step the decode graph takes (it takes every batch, width and key "
                              "count up to its own); a wider step runs eagerly")
    compile_prefill: bool = Field(
        True, description="on CPU, one more graph: a prompt chunk (up to prefill_chunk tokens) of any request, "
                          "while others decode; without it only a request that arrives alone prefills compiled")
    compile_workers: int = Field(
        1, ge=1, le=8, description="graphs compiled at once, a worker process each (its own memory beside the "
                                   "replica's, counted in the memory plan)")
    compile_dir: str | None = Field(
        None, description="where compiled graphs are kept (default: lookahead_graphs in inductor's cache folder)")
    compile_buckets: tuple[tuple[int, int], ...] = Field(
        ((1, 1), (1, 4), (1, 17)), description="CUDA only: the (batch, step width) shapes captured as CUDA graphs; "
                                               "a step runs in the smallest that holds it, padded, else eagerly")
    compile_kv: tuple[int, ...] = Field(
        (), description="CUDA only: key lengths the CUDA graphs hold at most (empty: the KV capacity); each one "
                        "doubles the graphs")
    weight_layout: Literal["auto", "plain", "transposed", "onednn"] = Field(
        "auto", description="how the one copy of the weights is laid out for the GEMMs that read it: auto is "
                            "transposed (MKL) in float32 on CPU, onednn (packed) in bf16/fp16 on CPU, plain on CUDA")

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _memory(cls, value):
        return None if value is None else parse_memory(value)

    @field_validator("history_tokens")
    @classmethod
    def _history(cls, value: int) -> int:
        if value == 1:  # SharedHistory keeps a text's last capacity - 1 tokens and a gap
            raise ValueError("history_tokens must be 0 (off) or at least 2, got 1")
        return value

    @field_validator("lookahead", mode="before")
    @classmethod
    def _lookahead(cls, value):
        return LookaheadParams(**value) if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _auto_fits(self) -> EngineConfig:
        try:
            self.check_params(self.lookahead)
        except ValueError as exc:
            raise ValueError(f"engine.lookahead (the \"auto\" setting) does not fit the engine: {exc}") from None
        return self

    @model_validator(mode="after")
    def _prefill_chunk_bounded(self) -> EngineConfig:
        # longer chunks only where max_seq_len says sequences are that long (generate()'s one-prompt engine)
        if self.prefill_chunk > MAX_PREFILL_CHUNK and (self.max_seq_len is None or self.prefill_chunk > self.max_seq_len):
            raise ValueError(f"prefill_chunk {self.prefill_chunk} exceeds {MAX_PREFILL_CHUNK} (more only up to a "
                             f"max_seq_len set that long, here {self.max_seq_len}): a prefill_chunk x prefill_chunk "
                             f"mask is allocated at start; set prefill_chunk to at most {MAX_PREFILL_CHUNK}")
        return self

    @model_validator(mode="after")
    def _buckets_fit(self) -> EngineConfig:
        if self.compile == "off" or self.compile_buckets == type(self).model_fields["compile_buckets"].default:
            return self
        if not self.compile_buckets:
            raise ValueError("compile is on but compile_buckets is empty (CUDA graphs need at least one shape)")
        for batch, width in self.compile_buckets:
            if not 1 <= batch <= self.max_batch:
                raise ValueError(f"compile bucket batch {batch} is outside [1, max_batch={self.max_batch}]")
            if not 1 <= width <= self.max_step_tokens:
                raise ValueError(f"compile bucket width {width} is outside [1, {self.max_step_tokens}], the widest "
                                 f"step max_n/max_w/max_g/max_lookup/max_successors allow")
        if self.compile_kv and min(self.compile_kv) < 1:  # one beyond the KV capacity means the capacity
            raise ValueError(f"compile_kv {min(self.compile_kv)} must be >= 1")
        return self

    def buckets_within(self, slots: int) -> tuple[tuple[int, int], ...]:
        """compile_buckets with batches above `slots` (what the KV budget holds) lowered to `slots`:
        a bucket of every slot still holds every step."""
        return tuple(dict.fromkeys((min(batch, slots), min(width, self.max_step_tokens))
                                   for batch, width in self.compile_buckets))

    def check_device(self, device: str) -> None:
        """Settings that apply to one kind of device only, refused on the other where set."""
        if device == "cpu":
            # not `model_fields_set`: a config that crossed a process as a dump has every field set
            cuda_only = [f for f in ("compile_buckets", "compile_kv") if getattr(self, f) != type(self).model_fields[f].default]
            if cuda_only and self.compile != "off":
                raise ValueError(f"engine.{' and engine.'.join(cuda_only)} set the shapes of CUDA graphs; on CPU one "
                                 f"decode graph takes every batch, width and key count (up to engine.compile_max_width "
                                 f"tokens a row): remove {' and '.join(cuda_only)}")

    @property
    def max_step_tokens(self) -> int:
        return LookaheadParams(self.max_n, self.max_w, self.max_g, lookup=self.max_lookup,
                               successors=self.max_successors).max_step_tokens

    def check_params(self, params: LookaheadParams | None) -> None:
        if params is None:
            return
        limits = (("n", params.n, self.max_n), ("w", params.w, self.max_w), ("g", params.g, self.max_g),
                  ("lookup", params.lookup, self.max_lookup), ("successors", params.successors, self.max_successors))
        for name, value, limit in limits:
            if value > limit:
                raise ValueError(f"lookahead {name}={value} exceeds this engine's limit of {limit}")

    def resolve(self, lookahead: LookaheadParams | str) -> LookaheadParams | None:
        """The (N, W, G) a request's `lookahead` runs: its own, this engine's for "auto", None for
        "off"; ValueError past the engine's limits."""
        if lookahead == "off":
            return None
        params = self.lookahead if lookahead == "auto" else lookahead
        if not isinstance(params, LookaheadParams):
            raise TypeError(f"lookahead must be 'auto', 'off' or LookaheadParams, got {lookahead!r}")
        self.check_params(params)
        return params

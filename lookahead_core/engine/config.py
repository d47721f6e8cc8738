"""Limits of the batching engine, validated once and passed in."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from lookahead_core.lookahead.params import LookaheadParams


class EngineConfig(BaseModel):
    """Sizes every buffer of the engine up front: slots x capacity of KV, step rows, masks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch: int = Field(16, ge=1, le=512, description="sequences decoded together (KV slots)")
    max_seq_len: int | None = Field(None, ge=2, description="prompt + new tokens; default: the model's context length")
    max_new_tokens: int = Field(512, ge=1, description="largest max_new_tokens a request may ask for")
    prefill_chunk: int = Field(128, ge=1, description="prompt tokens prefilled per engine step")
    max_waiting: int = Field(1024, ge=0, description="requests queued beyond the running ones")
    max_n: int = Field(8, ge=2)
    max_w: int = Field(16, ge=1)
    max_g: int = Field(16, ge=0)
    max_lookup: int = Field(16, ge=0, description="longest prompt-lookup candidate a request may ask for")
    shared_pool_cap: int = Field(
        8, ge=0, description="continuations per token in the replica's shared n-gram pool of finished requests' text; 0 turns it off"
    )
    shared_pool_keys: int = Field(16384, ge=1, description="first tokens kept per n-gram size in the shared pool")
    shared_pool_text: int = Field(
        512, ge=2, description="tokens at the end of a finished request (prompt tail and output) added to the shared pool"
    )

    @property
    def max_step_tokens(self) -> int:
        return LookaheadParams(self.max_n, self.max_w, self.max_g, lookup=self.max_lookup).max_step_tokens

    def check_params(self, params: LookaheadParams | None) -> None:
        if params is None:
            return
        limits = (("n", params.n, self.max_n), ("w", params.w, self.max_w), ("g", params.g, self.max_g),
                  ("lookup", params.lookup, self.max_lookup))
        for name, value, limit in limits:
            if value > limit:
                raise ValueError(f"lookahead {name}={value} exceeds this engine's limit of {limit}")

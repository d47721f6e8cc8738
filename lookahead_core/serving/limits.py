"""What one request may ask for beyond the engine's own limits, each limit in one place."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# A prompt of more characters than this times max_prompt_tokens is refused without tokenizing it.
MAX_CHARS_PER_TOKEN = 64
# Request bodies larger than this get 413 before they are parsed, unless `limits.max_body_bytes` says otherwise.
MAX_BODY_BYTES = 1 << 20


class RequestLimits(BaseModel):
    """What one request may ask for beyond the engine's own limits; anything beyond is a 4xx with a message."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_stop_strings: int = Field(16, ge=0)
    max_stop_chars: int = Field(256, ge=1)
    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1024, description="larger request bodies get 413 before they are parsed")
    max_prompt_tokens: int | None = Field(None, ge=1, description="default: the engine's max_seq_len - 1")
    max_request_tokens: int = Field(
        16384, ge=1, description="most tokens one request may put through the engine: n x (prompt + max_tokens)")
    request_timeout_s: float | None = Field(
        600, gt=0, description="ceiling on a request's life; a request's own `timeout_s` can only shorten it"
    )

"""Arguments of the Serve application, validated from serve_config.yaml's `args`."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from lookahead_core.engine_config import EngineConfig
from lookahead_core.router import RouterConfig

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def resolve_path(path: str) -> str:
    """Local paths may be relative to the working directory or to the project root (Serve
    replicas do not always start in the directory `serve run` was called from)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return str(p)
    for base in (Path.cwd(), PROJECT_ROOT):
        if (base / p).exists():
            return str((base / p).resolve())
    return path  # not local: a hub id


class ModelArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field("models/tiny-pycoder", description="local save_pretrained folder or hub id")
    name: str | None = Field(None, description="id shown by /v1/models; default: the folder name")
    dtype: str = "float32"
    device: str = "cpu"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False

    @property
    def served_name(self) -> str:
        return self.name or Path(self.path).name


class RequestLimits(BaseModel):
    """What one request may ask for; anything beyond is a 4xx with a message."""

    model_config = ConfigDict(extra="forbid")
    max_stop_strings: int = Field(16, ge=0)
    max_stop_chars: int = Field(256, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies get 413 before they are parsed")
    max_prompt_tokens: int | None = Field(None, ge=1, description="default: the engine's max_seq_len - 1")
    request_timeout_s: float | None = Field(
        600, gt=0, description="ceiling on a request's life; a request's own `timeout_s` can only shorten it"
    )


class AuthArgs(BaseModel):
    """Bearer-token auth; off when no key is configured (local use)."""

    model_config = ConfigDict(extra="forbid")
    api_keys: list[SecretStr] = Field(default_factory=list, description="accepted keys (prefer api_keys_env)")
    api_keys_env: str | None = Field(None, description="environment variable holding comma-separated keys")
    open_paths: list[str] = Field(["/health"], description="paths served without a key (load-balancer probes)")

    def resolve_keys(self, environ: Mapping[str, str]) -> list[str]:
        """The keys in force; a named but empty variable is an error, not auth silently off."""
        keys = [k.get_secret_value() for k in self.api_keys]
        if self.api_keys_env:
            raw = environ.get(self.api_keys_env, "")
            env_keys = [k.strip() for k in raw.split(",") if k.strip()]
            if not env_keys:
                raise ValueError(f"auth.api_keys_env names {self.api_keys_env!r} but that variable is unset or empty")
            keys += env_keys
        if any(len(k) < 16 for k in keys):
            raise ValueError("API keys must be at least 16 characters long")
        return keys


class AppArgs(BaseModel):
    """Everything the application builder needs; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")
    model: ModelArgs = ModelArgs()
    engine: EngineConfig = EngineConfig()
    router: RouterConfig = RouterConfig(policy="goodput", profile="configs/profiles/tiny-pycoder-cpu.yaml")
    limits: RequestLimits = RequestLimits()
    auth: AuthArgs = AuthArgs()
    num_gpus: float = Field(0, ge=0, description="GPUs per model replica")
    num_cpus: float = Field(1, ge=0, description="CPUs per model replica")

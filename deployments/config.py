"""Arguments of the Serve application, validated from serve_config.yaml's `args`."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from lookahead_core.engine.config import EngineConfig
from lookahead_core.models.loading import DEFAULT_MODEL
from lookahead_core.serving.limits import RequestLimits

from .core_plan import CorePlan

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
    path: str = Field(DEFAULT_MODEL, description="save_pretrained folder, hub id, GGUF file, or package:PKG/FILE")
    gguf_file: str | None = Field(None, description="GGUF file inside the folder `path`")
    name: str | None = Field(None, description="id shown by /v1/models; default: the folder or file name")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 where the device computes it natively, else float32 (bit-exact greedy)"
    )
    device: str = "cpu"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    cache_dir: str = Field(".cache/models", description="where GGUF models are cached, dequantized (relative: to the project)")
    chat_template: str | None = Field(
        None, description="Jinja chat template, or a path to a .jinja/.j2 file; default: the tokenizer's own"
    )

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        base = Path(self.gguf_file or self.path.split(":", 1)[-1]).name
        return base.removesuffix(".gguf")

    def resolved_cache_dir(self) -> str:
        p = Path(self.cache_dir).expanduser()
        return str(p if p.is_absolute() else PROJECT_ROOT / p)

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: str | None) -> str | None:
        """A .jinja/.j2 path is read here, where the config is built, so replicas get the text; a
        template that does not compile is a config error, not a 400 on every chat request."""
        if value is None:
            return None
        if value.endswith((".jinja", ".j2")):
            path = Path(resolve_path(value))
            if not path.is_file():
                raise ValueError(f"chat_template file {value!r} not found")
            value = path.read_text()
        try:
            jinja2.Environment().parse(value)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat_template does not compile: {exc}") from None
        return value


class AuthArgs(BaseModel):
    """Bearer-token auth; off when no key is configured (local use)."""

    model_config = ConfigDict(extra="forbid")
    api_keys: list[SecretStr] = Field(default_factory=list, description="accepted keys (prefer api_keys_env)")
    api_keys_env: str | None = Field(None, description="environment variable holding comma-separated keys")
    open_paths: list[str] = Field(["/health"], description="paths served without a key (load-balancer probes); "
                                  "/health answers them with its status alone")
    operator_keys_env: str | None = Field(
        None, description="environment variable holding comma-separated operator keys: only these read /health's "
                          "figures (traffic, caches, step costs); unset, any API key does")

    def resolve_keys(self, environ: Mapping[str, str]) -> list[str]:
        """The API keys in force; a named but empty variable is an error, not auth silently off."""
        return _keys([k.get_secret_value() for k in self.api_keys], self.api_keys_env, "api_keys_env", environ)

    def resolve_operator_keys(self, environ: Mapping[str, str]) -> list[str]:
        return _keys([], self.operator_keys_env, "operator_keys_env", environ)


def _keys(keys: list[str], var: str | None, field: str, environ: Mapping[str, str]) -> list[str]:
    if var:
        env_keys = [k.strip() for k in environ.get(var, "").split(",") if k.strip()]
        if not env_keys:
            raise ValueError(f"auth.{field} names {var!r} but that variable is unset or empty")
        keys = keys + env_keys
    if any(len(k) < 16 for k in keys):
        raise ValueError("API keys must be at least 16 characters long")
    return keys


class AppArgs(BaseModel):
    """Everything the application builder needs; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")
    model: ModelArgs = ModelArgs()
    engine: EngineConfig = EngineConfig()
    limits: RequestLimits = RequestLimits()
    auth: AuthArgs = AuthArgs()
    http_routes: Literal["model", "ingress"] = Field(
        "model", description="model: the model replicas serve the HTTP routes (Serve's proxy sends each request "
                             "straight to one); ingress: a separate ingress deployment does, and sends a request "
                             "again to another replica where its replica was lost before its first token")
    num_gpus: float = Field(0, ge=0, description="GPUs per model replica")
    num_cpus: float = Field(1, ge=0, description="CPUs per model replica")
    torch_threads: int | None = Field(
        None, ge=1, description="torch threads per replica; default: the core plan's (deployments/core_plan.py)")
    large_batch_threads: int | None = Field(
        None, ge=1, description="torch threads of a step of 8 sequences or more (its graphs compiled for them); "
                                "default: the core plan's (torch_threads, or every core where one is left to the HTTP "
                                "stack)")
    nice: int | None = Field(0, ge=-20, le=19, description="the engine's scheduling priority (Ray starts actors at 15); "
                                                           "null keeps Ray's")
    http_nice: int | None = Field(5, ge=-20, le=19, description="the scheduling priority of the HTTP stack on the "
                                  "replica's node: the replica's own process (with the engine in a process of its "
                                  "own) and Serve's proxy (Ray starts them at 15, where a step on every core starved "
                                  "them); null keeps Ray's")
    pin_cores: bool = Field(
        False, description="bind the engine's stepping thread to its torch threads' cores and the HTTP stack on its "
                           "node (the replica's process, Serve's proxy) to the rest; needs engine_process, the "
                           "replica on every core, and every step on fewer threads than cores (a step of 8 "
                           "sequences or more then runs on torch_threads too)")
    engine_process: bool = Field(
        True, description="the engine steps in a process of its own (its step never waits for the replica's Python, "
                          "the GIL); false: on a thread of the replica's process")
    report_replica_sources: bool = Field(
        False, description="a response's lookahead.sources includes the rows from other requests' text (shared, "
                           "history); off, a client cannot read from them whether another tenant's text continued "
                           "its prompt. /health and the metrics count them either way")

    def core_plan(self, cores: int | None = None) -> CorePlan:
        return CorePlan.build(self.num_cpus, self.torch_threads, self.nice, cores, own_process=self.engine_process,
                              large_batch_threads=self.large_batch_threads, http_nice=self.http_nice,
                              pin_cores=self.pin_cores)

"""Arguments of the Serve application, validated from serve_config.yaml's `args`."""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

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
    model_config = ConfigDict(extra="forbid")
    max_stop_strings: int = Field(16, ge=0)
    max_stop_chars: int = Field(256, ge=1)


class AppArgs(BaseModel):
    """Everything the application builder needs; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")
    model: ModelArgs = ModelArgs()
    engine: EngineConfig = EngineConfig()
    router: RouterConfig = RouterConfig(policy="goodput", profile="configs/profiles/tiny-pycoder-cpu.yaml")
    limits: RequestLimits = RequestLimits()
    num_gpus: float = Field(0, ge=0, description="GPUs per model replica")
    num_cpus: float = Field(1, ge=0, description="CPUs per model replica")

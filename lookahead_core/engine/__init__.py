"""The one decode path: a continuous-batching engine over a Hugging Face causal LM
(`generate`/`stream` run it with one request)."""
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine, EngineOverloaded
from lookahead_core.engine.host.async_engine import AsyncEngine, RequestTimeout
from lookahead_core.engine.io import StepOutput

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "EngineOverloaded", "RequestTimeout", "StepOutput"]

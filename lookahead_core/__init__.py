"""Exact Lookahead Decoding over Hugging Face causal LMs."""
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine, EngineOverloaded
from lookahead_core.engine.generation import GenerationResult, GenerationStats, generate, stream
from lookahead_core.engine.host.async_engine import AsyncEngine
from lookahead_core.engine.io import StepOutput
from lookahead_core.engine.runner.model_runner import ModelRunner
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineOverloaded",
    "GenerationResult",
    "GenerationStats",
    "LookaheadParams",
    "ModelRunner",
    "SamplingParams",
    "StepOutput",
    "generate",
    "stream",
]

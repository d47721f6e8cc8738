"""Exact Lookahead Decoding over Hugging Face causal LMs."""
from .decoder import SequenceDecoder
from .generation import GenerationResult, GenerationStats, generate, stream
from .kv_cache import SlotKVCache
from .layout import StepLayout
from .model_runner import ModelRunner
from .ngram_pool import NGramPool
from .params import LookaheadParams
from .sampling import SamplingParams
from .shared_pool import SharedNGramPool
from .stopping import StopCondition
from .verify import verify_greedy
from .window import LookaheadWindow

__all__ = [
    "GenerationResult",
    "GenerationStats",
    "LookaheadParams",
    "LookaheadWindow",
    "ModelRunner",
    "SamplingParams",
    "NGramPool",
    "SequenceDecoder",
    "SharedNGramPool",
    "SlotKVCache",
    "StepLayout",
    "StopCondition",
    "generate",
    "stream",
    "verify_greedy",
]

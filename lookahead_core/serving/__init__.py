"""The serving path without Ray: a typed request in, text deltas and a completion out."""
from lookahead_core.serving.outputs import (
                      FINISH_REASONS,
                      Completion,
                      Delta,
                      FinishReason,
                      Logprob,
                      LookaheadSummary,
                      RequestError,
                      Timings,
                      Usage,
                      finish_reason,
)
from lookahead_core.serving.processor import RequestProcessor, ServingLimits
from lookahead_core.serving.request import Message, ServeRequest
from lookahead_core.serving.text_stream import TextStream

__all__ = [
    "FINISH_REASONS",
    "Completion",
    "Delta",
    "FinishReason",
    "Logprob",
    "LookaheadSummary",
    "Message",
    "RequestError",
    "RequestProcessor",
    "ServeRequest",
    "ServingLimits",
    "Timings",
    "TextStream",
    "Usage",
    "finish_reason",
]

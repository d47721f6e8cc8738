"""The serving path without Ray: a typed request in, text deltas and a completion out."""
from lookahead_core.serving.limits import RequestLimits
from lookahead_core.serving.outputs import (
                      Completion,
                      Delta,
                      Logprob,
                      LookaheadSummary,
                      RequestError,
                      Timings,
                      Usage,
)
from lookahead_core.serving.processor import RequestProcessor
from lookahead_core.serving.request import Message, ServeRequest
from lookahead_core.serving.text_stream import TextStream

__all__ = [
    "Completion",
    "Delta",
    "Logprob",
    "LookaheadSummary",
    "Message",
    "RequestError",
    "RequestProcessor",
    "ServeRequest",
    "RequestLimits",
    "Timings",
    "TextStream",
    "Usage",
]

"""Server-sent event streams of the routes: /generate's events and OpenAI's chunks, each ending
with an error event where a request fails after its 200 has begun."""
from __future__ import annotations

from collections.abc import AsyncIterator

from lookahead_core.serving import Completion, Delta, RequestError, Usage, sse

from .response_bodies import error_body, generate_body, openai_chunk, openai_finish, openai_usage_chunk, total_usage, usage


def stream_error(err: RequestError) -> bytes:
    """An error after a streamed 200 has begun: the same envelope, plus the status it would have had."""
    return sse.encode({"error": {**error_body(err), "status": err.status}})


async def closing(events: AsyncIterator[bytes], items) -> AsyncIterator[bytes]:
    """Stream `events`; however the response ends (done, client gone), close `items` at once,
    which cancels the replica's generator and so frees the engine slot."""
    try:
        async for event in events:
            yield event
    finally:
        await items.aclose()


async def generate_events(items) -> AsyncIterator[bytes]:
    """/generate's SSE: {"token_ids", "text"} per step, then the completion with "done": true."""
    async for item in items:
        if isinstance(item, RequestError):
            yield stream_error(item)
            return
        yield sse.encode(item.to_dict() if isinstance(item, Delta) else generate_body(item, stream=True))
    yield sse.DONE_EVENT


async def openai_events(items, head: dict, chat: bool, include_usage: bool, n: int = 1,
                        continuous_usage: bool = False) -> AsyncIterator[bytes]:
    """SSE chunks as OpenAI streams them, each naming its choice; with include_usage every chunk
    has `usage: null` (with continuous_usage: the usage so far) and a last chunk with no choices
    carries the usage of all choices."""
    so_far: dict[int, Usage] = {}

    def event(chunk: dict) -> bytes:
        if continuous_usage and so_far:
            return sse.encode({**chunk, "usage": usage(total_usage(list(so_far.values())))})
        return sse.encode({**chunk, "usage": None} if include_usage else chunk)

    if chat:
        for i in range(n):
            yield event(openai_chunk(head, chat, role=True, index=i))
    done: list[Completion] = []
    offsets = [0] * n  # characters of each choice's logprob tokens so far, for text_offset
    async for item in items:
        if isinstance(item, RequestError):
            yield stream_error(item)
            return
        if item.usage is not None:
            so_far[item.index] = item.usage
        if isinstance(item, Completion):
            done.append(item)
            yield event(openai_chunk(head, chat, finish=openai_finish(item), index=item.index))
        elif item.text or item.logprobs or item.tool_calls:
            yield event(openai_chunk(head, chat, text=item.text, index=item.index, logprobs=item.logprobs,
                                     offset=offsets[item.index], tool_calls=item.tool_calls))
            offsets[item.index] += sum(len(lp.token) for lp in item.logprobs or ())
    if include_usage and done:
        yield sse.encode(openai_usage_chunk(head, chat, done))
    yield sse.DONE_EVENT

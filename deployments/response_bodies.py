"""HTTP response bodies: /generate's JSON, OpenAI's completions, chunks and usage, and the error
object every route answers with."""
from __future__ import annotations

from dataclasses import asdict

from lookahead_core.serving import Completion, Logprob, RequestError, Usage
from lookahead_core.serving.outputs import ToolCall
from lookahead_core.serving.tool_calls import finish_reason


def generate_body(c: Completion, stream: bool = False) -> dict:
    """/generate's JSON body; the last SSE event of a stream carries it with "done": true."""
    return {"done": True, **c.to_dict()} if stream else c.to_dict()


def error_body(err: RequestError) -> dict:
    """OpenAI's error object: 4xx are invalid_request_error, 503 overloaded_error, other 5xx server_error."""
    kind = err.type or ("invalid_request_error" if err.status < 500 else
                        "overloaded_error" if err.status == 503 else "server_error")
    return {"message": err.message, "type": kind, "param": err.param, "code": err.code}


# How a finish reason reads in OpenAI's vocabulary (the one place): a timeout is a cut like length.
OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "length", "abort": "abort"}


def openai_finish(c: Completion) -> str:
    """A choice's finish reason as OpenAI names it: "tool_calls" where it made calls and ended itself."""
    return finish_reason(c.tool_calls, OPENAI_FINISH[c.finish_reason])


def usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens}


def total_usage(usages: list[Usage]) -> Usage:
    """One prompt, every choice's tokens."""
    return Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages))


def completion_logprobs(lps: tuple[Logprob, ...], offset: int = 0) -> dict:
    """The completions API's logprobs; `text_offset` counts characters from the start of the
    choice's text (`offset`: what came before this chunk). Each `top_logprobs` entry holds the
    alternatives and the token itself, as vLLM returns them; a prompt's first token has none."""
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [None if lp.logprob is None else {**dict(lp.top), lp.token: lp.logprob} for lp in lps],
            "text_offset": offsets}


def chat_logprobs(lps: tuple[Logprob, ...]) -> dict:
    def entry(token: str, logprob: float | None) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}


def _logprobs(lps: tuple[Logprob, ...] | None, chat: bool, offset: int = 0) -> dict | None:
    if lps is None:
        return None
    return chat_logprobs(lps) if chat else completion_logprobs(lps, offset)


def chat_message(c: Completion) -> dict:
    """The assistant's message: its content (None where it made calls and wrote nothing else) and calls."""
    if not c.tool_calls:
        return {"role": "assistant", "content": c.text}
    return {"role": "assistant", "content": c.text or None, "tool_calls": [call.openai() for call in c.tool_calls]}


def openai_body(head: dict, completions: list[Completion], chat: bool) -> dict:
    """The whole response: one choice per Completion (n of them), usage over all."""
    choices = []
    for c in sorted(completions, key=lambda c: c.index):
        choice = {"index": c.index, "logprobs": _logprobs(c.logprobs, chat), "finish_reason": openai_finish(c)}
        choice.update({"message": chat_message(c)} if chat else {"text": c.text})
        choices.append(choice)
    kind = "chat.completion" if chat else "text_completion"
    return {**head, "object": kind, "choices": choices, "usage": usage(total_usage([c.usage for c in completions])),
            "lookahead": asdict(completions[0].lookahead)}


def openai_chunk(head: dict, chat: bool, text: str | None = None, finish: str | None = None, role: bool = False,
                 index: int = 0, logprobs: tuple[Logprob, ...] | None = None, offset: int = 0,
                 tool_calls: tuple[ToolCall, ...] = ()) -> dict:
    """One streamed chunk of choice `index`: a role announcement, a text delta (with its tokens'
    logprobs) and the calls it completed, each whole, or the finish (OpenAI's reason given)."""
    lps = _logprobs(logprobs, chat, offset)
    if chat:
        calls = {"tool_calls": [call.delta() for call in tool_calls]} if tool_calls else {}
        content = {} if text is None or (calls and not text) else {"content": text}
        delta = {"role": "assistant"} if role else {**content, **calls}
        choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
        return {**head, "object": "chat.completion.chunk", "choices": [choice]}
    choice = {"index": index, "text": text or "", "logprobs": lps, "finish_reason": finish}
    return {**head, "object": "text_completion", "choices": [choice]}


def openai_usage_chunk(head: dict, chat: bool, completions: list[Completion]) -> dict:
    """The stream's last chunk: the usage of all choices and, as the whole body has it, the first
    choice's lookahead summary (its steps and tokens per step)."""
    first = min(completions, key=lambda c: c.index)
    return {**head, "object": "chat.completion.chunk" if chat else "text_completion", "choices": [],
            "usage": usage(total_usage([c.usage for c in completions])), "lookahead": asdict(first.lookahead)}


"""The one load-generation client: a streamed request timed token by token (`/generate`'s events or
OpenAI's chat chunks, so the same client measures this server and any OpenAI-compatible one),
closed-loop users, and percentiles. `benchmarks.bench_http`, `benchmarks.bench_serving`, the cluster
runs and the locust file use it."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from lookahead_core.serving import sse


def read_prompts(spec: str, count: int | None = None) -> list[str]:
    """Prompts from a JSONL file (`{"prompt": ...}` per line) or a set name under benchmarks/prompts;
    with `count`, that many spread evenly over the file."""
    path = Path(spec) if spec.endswith(".jsonl") else Path(__file__).resolve().parent.parent / "benchmarks" / "prompts" / f"{spec}.jsonl"
    lines = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    if count is None:
        return lines
    return lines[:: max(len(lines) // count, 1)][:count]


def lookahead_field(spec: str) -> str | dict[str, int]:
    """`auto`, `off` or "n,w,g" as /generate's `lookahead` field."""
    if spec in ("auto", "off"):
        return spec
    n, w, g = (int(x) for x in spec.split(","))
    return {"n": n, "w": w, "g": g}


# Kinds of request a mixed load sends (`--mix`): what each adds to a /generate body.
REQUEST_KINDS: dict[str, dict[str, Any]] = {
    "auto": {"lookahead": "auto"},
    "off": {"lookahead": "off"},
    "fixed": {"lookahead": {"n": 5, "w": 8, "g": 8, "adapt": False}},  # the widest a client may fix
    "top_p": {"lookahead": "auto", "temperature": 0.8, "top_p": 0.95},
    # a flat distribution: top_p keeps most of the vocabulary
    "hot": {"lookahead": "auto", "temperature": 2.0, "top_p": 0.99},
    "stop": {"lookahead": "auto", "stop": ["\n\n", "\n#"]},
    # n choices of one prompt: on /v1/completions (/generate takes one), sampled, streamed with usage
    "choices": {"n": 4, "temperature": 0.8},
}


def parse_mix(spec: str) -> dict[str, float]:
    """"off=4,fixed=1" -> {kind: weight}; the kinds are REQUEST_KINDS'."""
    mix = {}
    for part in spec.split(","):
        kind, _, weight = part.partition("=")
        if kind.strip() not in REQUEST_KINDS:
            raise ValueError(f"unknown request kind {kind.strip()!r} in the mix; kinds: {', '.join(REQUEST_KINDS)}")
        mix[kind.strip()] = float(weight or 1)
    if not any(w > 0 for w in mix.values()):
        raise ValueError(f"the mix {spec!r} has no positive weight")
    return mix


def route_for(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Where a /generate body goes: /generate, or with `n` choices /v1/completions (/generate takes one)."""
    if "n" not in body:
        return "/generate", body
    return "/v1/completions", {"prompt": body["prompt"], "max_tokens": body["max_new_tokens"], "n": body["n"],
                               "temperature": body["temperature"], "stream": True,
                               "stream_options": {"include_usage": True}}


def generate_body(prompt: str, *, chat: bool, max_new_tokens: int, lookahead: str | dict = "auto",
                  temperature: float = 0.0) -> dict[str, Any]:
    """A streamed /generate body; `chat` sends the prompt as a user message (the chat template)."""
    text: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    return {**text, "max_new_tokens": max_new_tokens, "temperature": temperature, "lookahead": lookahead, "stream": True}


def prompt_cycle(prompts: list[str], *, chat: bool, max_new_tokens: int, lookahead: str | dict = "auto",
                 temperature: float = 0.0) -> Callable[[int, int], dict[str, Any]]:
    """`body(user, k)`: user's k-th request, each user cycling through `prompts` from its own offset."""
    def body(user: int, k: int) -> dict[str, Any]:
        return generate_body(prompts[(user * 7 + k) % len(prompts)], chat=chat, max_new_tokens=max_new_tokens,
                             lookahead=lookahead, temperature=temperature)
    return body


def chat_body(prompt: str, *, max_tokens: int, model: str, temperature: float = 0.0,
              **extra: Any) -> dict[str, Any]:
    """A streamed `/v1/chat/completions` body that asks for the usage chunk (completion tokens)."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}, **extra}


@dataclass
class Outcome:
    """One request as the client saw it; times from `time.time()`."""
    start: float
    end: float = 0.0
    status: int = 0                 # HTTP status; a mid-stream error keeps 200 and sets error
    tokens: int = 0                 # token ids received
    first: float | None = None      # when the first token arrived
    last: float | None = None       # when the last token arrived
    summary: dict | None = None     # the final event: usage, finish_reason, lookahead
    error: str | None = None        # the server's message, or the client's timeout/connection error
    user: int = 0

    @property
    def ok(self) -> bool:
        return self.summary is not None and self.error is None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


def read_stream(out: Outcome, lines: Iterable[bytes | str], clock: Callable[[], float] = time.time) -> Outcome:
    """Fill `out` from /generate's SSE lines: token times, the summary, or the error event."""
    for event in sse.events(lines):
        if event == sse.DONE:
            break
        if "error" in event:  # e.g. the replica died mid-stream: the HTTP status stays 200
            out.error = event["error"].get("message") or json.dumps(event["error"])
            break
        if event.get("done"):
            out.summary = event
        elif event.get("token_ids"):
            now = clock()
            out.first = now if out.first is None else out.first
            out.last = now
            out.tokens += len(event["token_ids"])
    if out.summary is None and out.error is None:
        out.error = "the stream ended without its summary"
    out.end = clock()
    return out


def read_openai_stream(out: Outcome, lines: Iterable[bytes | str], clock: Callable[[], float] = time.time) -> Outcome:
    """Fill `out` from an OpenAI stream (chat's `delta.content`, completions' `text`): a chunk with
    text is a token arrival, the usage chunk is the summary and its completion tokens the count (a
    server may put several tokens in a chunk)."""
    chunks = 0
    for event in sse.events(lines):
        if event == sse.DONE:
            break
        if "error" in event:
            out.error = event["error"].get("message") or json.dumps(event["error"])
            break
        if any(c.get("text") or (c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
            now = clock()
            out.first = now if out.first is None else out.first
            out.last = now
            chunks += 1
        if event.get("usage"):
            out.summary = event
    if out.summary is not None:
        out.tokens = out.summary["usage"]["completion_tokens"]
    elif out.error is None:
        out.tokens = chunks
        out.error = "the stream ended without its usage chunk"
    out.end = clock()
    return out


def generate(url: str, body: dict, timeout_s: float = 600, user: int = 0,
             session: requests.Session | None = None, route: str = "/generate") -> Outcome:
    """POST a streamed body to `url` + `route` (/generate, or an OpenAI chat route) and time it;
    never raises for HTTP or network errors."""
    out = Outcome(start=time.time(), user=user)
    read = read_stream if route == "/generate" else read_openai_stream
    try:
        with (session or requests).post(url + route, json=body, stream=True, timeout=timeout_s) as r:
            out.status = r.status_code
            if r.status_code != 200:
                try:
                    out.error = r.json().get("error", {}).get("message", r.text)
                except ValueError:
                    out.error = r.text[:200]
                out.end = time.time()
                return out
            return read(out, r.iter_lines())
    except requests.RequestException as exc:
        out.error, out.end = f"client: {type(exc).__name__}: {exc}", time.time()
        return out


@dataclass
class ClosedLoop:
    """`users` threads, each sending its next request as soon as the last one ends, until `stop()`,
    the deadline given to `run`, or `body(user, k)` (user's k-th request body) gives None."""
    url: str
    users: int
    body: Callable[[int, int], dict | None]
    timeout_s: float = 600
    route: str = "/generate"
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._deadline = float("inf")
        self._threads = [threading.Thread(target=self._loop, args=(u,), daemon=True) for u in range(self.users)]

    def _loop(self, user: int) -> None:
        k = 0
        with requests.Session() as session:
            while not self._stop.is_set() and time.time() < self._deadline:
                body = self.body(user, k)
                if body is None:
                    break
                out = generate(self.url, body, self.timeout_s, user, session, self.route)
                k += 1
                with self._lock:
                    self.outcomes.append(out)

    def start(self) -> ClosedLoop:
        for t in self._threads:
            t.start()
        return self

    def stop(self, join_timeout_s: float = 180) -> list[Outcome]:
        """Stop sending; wait for the requests in flight (each bounded by its own timeout)."""
        self._stop.set()
        for t in self._threads:
            t.join(join_timeout_s)
        with self._lock:
            return list(self.outcomes)

    def run(self, duration_s: float) -> list[Outcome]:
        """Send for `duration_s`, then wait for the last requests to end."""
        self._deadline = time.time() + duration_s
        self.start()
        for t in self._threads:
            t.join()
        return list(self.outcomes)


def each_once(bodies: list[dict]) -> Callable[[int, int], dict | None]:
    """`body(user, k)` handing out `bodies` once each, in order, to whichever user asks next."""
    lock, it = threading.Lock(), iter(bodies)

    def body(user: int, k: int) -> dict | None:
        with lock:
            return next(it, None)
    return body


def percentiles(values: Iterable[float | None], qs: Iterable[int] = (50, 95)) -> dict[str, float | None]:
    """Nearest-rank percentiles of the values that are not None."""
    s = sorted(v for v in values if v is not None)
    return {f"p{q}": round(s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))], 4) if s else None for q in qs}

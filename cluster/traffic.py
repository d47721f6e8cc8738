"""Closed-loop streaming clients for the cluster runs: each user sends its next request when the
last one ends, and every request's outcome (done, a clear error, or a hang) is recorded."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Self

import requests

from lookahead_core.serving import sse

PROMPTS = [  # asked through the chat template, so the model answers at length
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash map works, step by step.",
    "List five facts about the Moon.",
    "Describe a walk through a forest in autumn.",
]


@dataclass
class Outcome:
    user: int
    start: float
    end: float
    status: int                # HTTP status; a mid-stream error keeps 200 and sets error
    tokens: int                # text chunks received
    done: bool                 # the stream reached [DONE] after a finish_reason
    error: str | None = None   # the server's message, or the client's timeout/connection error
    first: float | None = None # when the first text chunk arrived

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def ok(self) -> bool:
        return self.done and self.error is None


def stream_once(url: str, model: str, user: int, max_tokens: int, timeout_s: float) -> Outcome:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[user % len(PROMPTS)]}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0}
    start, first, tokens, finished, error, status = time.time(), None, 0, False, None, 0
    try:
        with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=timeout_s) as r:
            status = r.status_code
            if status != 200:
                error = r.json().get("error", {}).get("message", r.text)
                return Outcome(user, start, time.time(), status, 0, False, error)
            for chunk in sse.events(r.iter_lines()):
                if chunk == sse.DONE:
                    return Outcome(user, start, time.time(), status, tokens, finished, error, first)
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    continue
                choice = chunk["choices"][0]
                if choice["delta"].get("content"):
                    tokens += 1
                    first = first or time.time()
                finished = finished or choice.get("finish_reason") is not None
    except requests.RequestException as exc:
        error = f"client: {type(exc).__name__}: {exc}"
    return Outcome(user, start, time.time(), status, tokens, False, error or "stream ended without [DONE]", first)


class Users:
    """`users` closed-loop threads against `url` until stop(); outcomes in .outcomes."""

    def __init__(self, url: str, model: str, users: int, max_tokens: int, timeout_s: float = 120) -> None:
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(url, model, u, max_tokens, timeout_s), daemon=True)
                         for u in range(users)]

    def _loop(self, url, model, user, max_tokens, timeout_s) -> None:
        while not self._stop.is_set():
            out = stream_once(url, model, user, max_tokens, timeout_s)
            with self._lock:
                self.outcomes.append(out)

    def start(self) -> Self:
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


def percentiles(values: list[float], qs=(50, 95)) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in qs}
    s = sorted(values)
    return {f"p{q}": round(s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))], 3) for q in qs}

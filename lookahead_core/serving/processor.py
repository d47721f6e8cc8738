"""One request through the engine: tokens in, text deltas and a completion out, errors as HTTP statuses."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING

from jinja2 import TemplateError

from lookahead_core.constraints.grammar import grammar_tokenizer
from lookahead_core.engine.engine import EngineOverloaded
from lookahead_core.engine.host.async_engine import AsyncEngine, RequestTimeout
from lookahead_core.engine.io import EngineRequest, SequenceStats, StepOutput
from lookahead_core.lookahead.stopping import FinishReason, StopCondition
from lookahead_core.serving.choice_run import FAILURES, ChoiceRun
from lookahead_core.serving.limits import MAX_CHARS_PER_TOKEN, RequestLimits
from lookahead_core.serving.outputs import Completion, Delta, RequestError
from lookahead_core.serving.request import DEFAULT_MAX_NEW_TOKENS, ServeRequest
from lookahead_core.serving.text_stream import TextStream
from lookahead_core.serving.tools import render_tool_prompt, template_takes_tools

if TYPE_CHECKING:
    from llguidance import LLTokenizer

log = logging.getLogger(__name__)


class RequestProcessor:
    """Tokenizes requests, drives them through an AsyncEngine and turns their tokens into text.

    Ray-free: the replica wraps it, tests drive it with a real engine directly. `vocab_size`: the
    model's (token ids named by a request must be below it; None: the tokenizer's largest id + 1)."""

    def __init__(self, tokenizer, eos_token_ids: Iterable[int] = (), limits: RequestLimits | None = None,
                 model_name: str = "model", vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos = tuple(eos_token_ids)
        self.limits = limits or RequestLimits(request_timeout_s=None)
        self.model_name = model_name
        self.vocab_size = max(tokenizer.get_vocab().values()) + 1 if vocab_size is None else vocab_size
        self._grammar_tokenizer: LLTokenizer | None = None  # llguidance's view of the tokenizer, built for the first grammar

    # ---- before the engine --------------------------------------------------------------------

    def check_prompt_size(self, req: ServeRequest) -> None:
        """Refuse text far beyond the token limit before tokenizing it (a 1 MiB body would take
        hundreds of milliseconds to tokenize only to be refused): text averages a few characters a
        token, and `MAX_CHARS_PER_TOKEN` is far above any tokenizer's average. A chat's calls and tools count as
        the JSON they are rendered as."""
        limit = self.limits.max_prompt_tokens
        if limit is None or req.input_ids is not None:
            return
        if req.prompt is not None:
            chars = len(req.prompt)
        else:
            turns = req.messages or ()
            chars = sum(len(m.content or "") + (len(json.dumps(m.tool_calls, default=str)) if m.tool_calls else 0) for m in turns)
            chars += sum(len(json.dumps(t.openai())) for t in req.tool_choice.offered(req.tools))
        if chars > MAX_CHARS_PER_TOKEN * limit:
            raise RequestError(400, f"the prompt has {chars} characters, more than {limit} tokens of text can hold; "
                                    f"this server accepts at most {limit} prompt tokens")

    def tokenize(self, req: ServeRequest) -> list[int]:
        """The prompt's token ids: given, tokenized text, or the chat template's rendering of `messages` with the tools
        offered (as `tools` to a template that takes them, else in the system turn)."""
        self.check_prompt_size(req)
        if req.input_ids is not None:
            ids = list(req.input_ids)
        elif req.messages is not None:
            if not self.tokenizer.chat_template:
                raise RequestError(400, f"model {self.model_name!r} has no chat template: send `prompt` instead, "
                                        "or set model.chat_template in the server config", "messages")
            takes_tools = template_takes_tools(self.tokenizer.chat_template)
            turns, kwargs = render_tool_prompt(takes_tools, [m.to_dict() for m in req.messages], req.tools, req.tool_choice)
            try:
                ids = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False, **kwargs)
            except TemplateError as exc:  # templates raise on conversations they refuse
                raise RequestError(400, f"the model's chat template refused these messages: {exc}",
                                   "messages") from None
        else:
            ids = self.tokenizer(req.prompt)["input_ids"]
        limit = self.limits.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            raise RequestError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {limit}")
        return ids

    def check_stops(self, stops: tuple[str, ...]) -> None:
        n, chars = self.limits.max_stop_strings, self.limits.max_stop_chars
        if len(stops) > n or any(not s or len(s) > chars for s in stops):
            raise RequestError(400, f"`stop` takes at most {n} non-empty strings of at most {chars} characters", "stop")

    def check_options(self, req: ServeRequest) -> None:
        """Token ids the request names within the vocabulary; its grammar one llguidance can follow
        with this tokenizer (GrammarSpec.check), before the engine sees it."""
        top = self.vocab_size - 1
        for field, largest in (("logit_bias", -1 if req.rules is None else req.rules.max_token),
                               ("stop_token_ids", max(req.stop_token_ids, default=-1))):
            if largest > top:
                raise RequestError(400, f"`{field}` names token {largest}, beyond the vocabulary (ids 0..{top})", field)
        if req.grammar is None:
            return
        field = req.grammar_field
        try:
            grammars = self.prepare_grammars()
        except ValueError as exc:
            raise RequestError(400, f"`{field}` is not supported for model {self.model_name!r}: its tokenizer "
                                    f"cannot constrain output ({exc})", field, "unsupported_parameter") from None
        try:
            req.grammar.check(grammars)
        except ValueError as exc:
            raise RequestError(400, f"`{field}`: {exc}", field) from None

    def prepare_grammars(self) -> LLTokenizer:
        """llguidance's view of the tokenizer, built once (it reads the whole vocabulary: the replica
        builds it at start, not on a request's path); ValueError where llguidance cannot read it."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.vocab_size)
        return self._grammar_tokenizer

    def timeout(self, req: ServeRequest) -> float | None:
        """The request's own timeout_s, capped by the server's request_timeout_s."""
        limits = [t for t in (req.timeout_s, self.limits.request_timeout_s) if t is not None]
        return min(limits) if limits else None

    # ---- the request ----------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        """One token as text (a piece of a multi-byte character comes out as U+FFFD; an id the
        tokenizer has no piece for, as "")."""
        tok = self.tokenizer
        piece = tok.convert_ids_to_tokens(token_id)
        return "" if piece is None else tok.convert_tokens_to_string([piece])

    @staticmethod
    def budget(req: ServeRequest, prompt: list[int], token_limit: int, max_seq_len: int) -> int:
        """New tokens a choice may decode: the request's own, or `DEFAULT_MAX_NEW_TOKENS`, or less where
        the engine's `token_limit` or the room `max_seq_len` leaves after the prompt is lower (an
        explicit budget above either is refused by the engine)."""
        if req.max_new_tokens is not None:
            return req.max_new_tokens
        return max(1, min(DEFAULT_MAX_NEW_TOKENS, token_limit, max_seq_len - len(prompt)))

    def check_work(self, req: ServeRequest, prompt: list[int], budget: int) -> None:
        """A request's tokens through the engine, n x (prompt + budget), within `max_request_tokens`;
        its budget no shorter than its `min_tokens` (which could never be met)."""
        floor = 0 if req.rules is None else req.rules.min_tokens
        if floor > budget:
            given = "max_tokens" if req.max_new_tokens is not None else "the default max_tokens for this prompt"
            raise RequestError(400, f"min_tokens={floor} is more than {given} ({budget})", "min_tokens")
        work, limit = req.n * (len(prompt) + budget), self.limits.max_request_tokens
        if work > limit:
            raise RequestError(400, f"n={req.n} choices of {len(prompt)} prompt tokens plus max_tokens={budget} "
                                    f"come to {work} tokens, over this server's limit of {limit} per request", "n")

    def engine_request(self, req: ServeRequest, prompt: list[int], token_limit: int, max_seq_len: int,
                       group: str | None = None) -> EngineRequest:
        """The one request the engine takes, built once from the served request (`group`: the
        request it is one choice of)."""
        stop = StopCondition.build(self.budget(req, prompt, token_limit, max_seq_len), () if req.ignore_eos else self.eos,
                                   req.stop_token_ids)
        return EngineRequest(req.request_id, tuple(prompt), stop, req.lookahead, req.sampling, req.logprobs,
                             req.logprobs if req.echo else None, group, rules=req.rules, grammar=req.grammar)

    async def run(self, req: ServeRequest, engine: AsyncEngine) -> AsyncIterator[Delta | Completion]:
        """Yield a Delta per engine step that accepted tokens (and one for text held to the end),
        then the Completion; with n > 1, the choices' items interleaved as they come, each
        Completion last for its index. Raises RequestError: 400 for a request the server or engine
        refuses, 503 when the engine's queue is full, 408/504 for a deadline passed before the
        first token, 500 when a step failed."""
        self.check_stops(req.stop)
        self.check_options(req)
        # On the loop, bounded by check_prompt_size: a worker thread would race the loop's decodes on
        # the one Rust tokenizer (encoding sets its truncation state: "Already borrowed").
        prompt = self.tokenize(req)
        self.check_work(req, prompt, self.budget(req, prompt, engine.limits.max_new_tokens, engine.limits.max_seq_len))
        if req.n == 1:
            async for item in self._run_one(req, prompt, 0, engine):
                yield item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def choice(i: int) -> None:
            sampling = req.sampling
            if sampling is not None and sampling.seed is not None:
                sampling = dataclasses.replace(sampling, seed=sampling.seed + i)
            sub = dataclasses.replace(req, n=1, sampling=sampling, request_id=f"{req.request_id}-{i}")
            try:
                async for item in self._run_one(sub, prompt, i, engine, group=req.request_id):
                    await queue.put(item)
            except RequestError as err:
                await queue.put(err)
            except Exception as exc:  # a choice must never leave the merge waiting
                await queue.put(RequestError(500, f"generation failed: {exc}"))

        tasks = [asyncio.create_task(choice(i)) for i in range(req.n)]
        try:
            done = 0
            while done < req.n:
                item = await queue.get()
                if isinstance(item, RequestError):
                    raise item
                done += isinstance(item, Completion)
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_one(self, req: ServeRequest, prompt: list[int], index: int, engine: AsyncEngine,
                       group: str | None = None) -> AsyncIterator[Delta | Completion]:
        try:
            ereq = self.engine_request(req, prompt, engine.limits.max_new_tokens, engine.limits.max_seq_len, group)
            params = engine.resolve(ereq)
        except (ValueError, TypeError) as exc:
            raise RequestError(400, str(exc)) from None
        text = TextStream(self.tokenizer, req.stop, req.stop_token_ids, 0 if req.rules is None else req.rules.min_tokens)
        run = ChoiceRun(req, ereq, params, prompt, index, self.timeout(req), text, self.token_text,
                        lambda: req.prompt if req.prompt is not None else self.tokenizer.decode(prompt))
        stream = engine.generate(ereq, run.timeout_s)
        try:
            async for out in stream:
                deltas = run.on_output(out)
                if run.hit:  # the engine hears before the client reads: fewer steps run past the stop
                    engine.finish(ereq.request_id, FinishReason.STOP, len(run.tokens))
                for delta in deltas:
                    yield delta
                if run.hit:  # unless the engine had ended it in this very step, its count comes next
                    run.stats = out.stats if out.finish_reason is not None else await _final_stats(stream)
                    break
                if out.finish_reason is not None:
                    break
        except FAILURES as exc:
            if isinstance(exc, RuntimeError) and not isinstance(exc, EngineOverloaded):
                log.error("request %s failed: %s", req.request_id, exc)
            run.fail(exc)
        finally:
            await stream.aclose()
        for delta in run.tail():
            yield delta
        yield run.completion()


async def _final_stats(stream: AsyncIterator[StepOutput]) -> SequenceStats | None:
    """The engine's count of a request the caller ended (`AsyncEngine.finish`), from the output
    with its finish reason (a step or two away; outputs before it are past the end and dropped).
    None where the stream ends without it: its deadline passed, a step failed, the engine stopped."""
    try:
        async for out in stream:
            if out.finish_reason is not None:
                return out.stats
    except (RequestTimeout, RuntimeError):
        pass
    return None

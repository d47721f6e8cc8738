"""Grammars a request's output must follow (JSON schema, JSON, regex, choice, Lark/GBNF), through
llguidance: the spec as a value, checked once against the tokenizer, and the matchers the engine
advances along each request's accepted tokens."""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_CHARS = 1 << 17
# matchers built for a grammar are copied from one kept per grammar text, least recently used out
CACHED_GRAMMARS = 64
# JSON as json.dumps writes it (", " and ": ", no other whitespace), unless a schema's x-guidance
# says otherwise: whitespace the model may add at will lets a small model loop in it, and a fixed
# layout makes the text between values forced, which lookahead verifies in the step it is proposed
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. kind "json": a JSON schema (`source` its JSON text);
    "json_object": any JSON object (source ignored); "regex"; "choice": a JSON list of strings;
    "grammar": a Lark or GBNF grammar (llguidance reads both)."""

    kind: GrammarKind
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"a grammar's source must be a string, got {type(self.source).__name__}")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"a grammar's source may hold at most {MAX_GRAMMAR_CHARS} characters")
        if self.kind != "json_object" and not self.source.strip():
            raise ValueError(f"the {self.kind} grammar is empty")

    @classmethod
    def json_schema(cls, schema: Any) -> GrammarSpec:
        """The schema's properties keep their order: the output follows it."""
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        if not options or not all(isinstance(o, str) for o in options):
            raise ValueError("choice must be a non-empty list of strings")
        return cls("choice", json.dumps(list(options)))

    def llguidance(self) -> str:
        """llguidance's grammar text; ValueError where the source does not parse as its kind."""
        try:
            if self.kind in ("json", "json_object"):
                schema = self.source if self.kind == "json" else '{"type": "object"}'
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)  # type: ignore[arg-type]
            return llguidance.grammar_from(self.kind, self.source)  # type: ignore[arg-type]  # "json_object" left above
        except (ValueError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"the {self.kind} grammar does not parse: {exc}") from None

    def check(self, tokenizer: LLTokenizer) -> None:
        """ValueError naming what is wrong where llguidance cannot build a matcher for it."""
        error = LLMatcher.validate_grammar(self.llguidance(), tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"the {self.kind} grammar is not valid: {error.strip()}")


def grammar_tokenizer(hf_tokenizer, vocab_size: int | None = None) -> LLTokenizer:
    """llguidance's view of a Hugging Face tokenizer (its token bytes), `vocab_size` rows wide: read
    from its byte-level or byte-fallback model, else (a word-level vocabulary, say) from each
    token's decoded text."""
    try:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
    except ValueError:
        return LLTokenizer(TokenizerWrapper(_DecodedVocab(hf_tokenizer, vocab_size)),
                                      n_vocab=vocab_size)


class _DecodedVocab:
    """A tokenizer as llguidance's `TokenizerWrapper` reads one: each token's bytes from its text."""

    def __init__(self, hf_tokenizer, vocab_size: int | None) -> None:
        self._tok = hf_tokenizer
        n = vocab_size or len(hf_tokenizer)
        special = set(hf_tokenizer.all_special_ids)
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.special_token_ids = sorted(t for t in special if t < n)
        # ids the tokenizer lacks get a byte string no text contains, so no grammar admits them
        names = hf_tokenizer.convert_ids_to_tokens(list(range(n)))
        self.tokens = [b"\xff\xfe%d" % i if name is None else f"<{name}>".encode() if i in special
                       else hf_tokenizer.decode([i]).encode() for i, name in enumerate(names)]

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)


class Grammars:
    """The engine's matchers: one per constrained request, copied from one built per grammar text."""

    def __init__(self, tokenizer: LLTokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._built: OrderedDict[GrammarSpec, LLMatcher] = OrderedDict()

    def matcher(self, spec: GrammarSpec) -> GrammarState:
        """A fresh matcher for `spec`; ValueError where it cannot be built."""
        built = self._built.get(spec)
        if built is None:
            built = LLMatcher(self.tokenizer, spec.llguidance(), log_level=0)
            if built.is_error():
                raise ValueError(f"the {spec.kind} grammar is not valid: {built.get_error()}")
            self._built[spec] = built
            if len(self._built) > CACHED_GRAMMARS:
                self._built.popitem(last=False)
        self._built.move_to_end(spec)
        return GrammarState(built.deep_copy(), self.vocab_size)


class GrammarState:
    """One request's matcher: the tokens it accepted so far, the mask of the next, forced runs."""

    def __init__(self, matcher: LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        words = (vocab_size + 31) // 32
        self._bits = np.zeros(words, dtype=np.int32)
        self._shift = torch.arange(32, dtype=torch.int32)

    def _fill(self) -> np.ndarray:
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return self._bits

    def allows(self, token: int) -> bool:
        """Whether the grammar takes `token` next (its mask, without unpacking it)."""
        return bool((int(self._fill()[token >> 5]) >> (token & 31)) & 1)

    def allowed(self) -> torch.Tensor:
        """A bool [vocab_size] of the tokens the grammar takes next."""
        bits = torch.from_numpy(self._fill())
        return ((bits.unsqueeze(1) >> self._shift) & 1).flatten()[: self.vocab_size].bool()

    def mask_(self, row: torch.Tensor) -> torch.Tensor:
        """The logits `row` [V] with the tokens the grammar refuses at -inf (in place)."""
        return row.masked_fill_(~self.allowed().to(row.device), -torch.inf)

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    def rollback(self, n: int) -> None:
        if n and not self.matcher.rollback(n):
            raise RuntimeError(f"the grammar could not roll back {n} tokens: {self.matcher.get_error()}")

    def valid_prefix(self, tokens: tuple[int, ...] | list[int]) -> int:
        """How many of `tokens` the grammar takes from here."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def forced_run(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar leads to from here: its fast-forward tokens (the forced
        text, tokenized canonically), then while exactly one token is legal, that token."""
        m = self.matcher
        run = m.compute_ff_tokens()[:limit]
        # forced text the vocabulary cannot write tokenizes to tokens the grammar refuses: cut there,
        # before consuming (a matcher that consumed a refused token stays in error)
        run = run[: m.validate_tokens(run)] if run else run
        if run and not m.consume_tokens(run):
            raise RuntimeError(f"the grammar refused its own forced tokens: {m.get_error()}")
        bits = self._bits
        while len(run) < limit and not m.is_stopped():
            m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            if int(np.bitwise_count(bits.view(np.uint32)).sum()) != 1:
                break
            word = int(np.flatnonzero(bits)[0])
            token = word * 32 + int(bits.view(np.uint32)[word]).bit_length() - 1
            if token >= self.vocab_size or not m.consume_token(token):
                break
            run.append(token)
        self.rollback(len(run))
        return run

    @property
    def done(self) -> bool:
        """Nothing but an end token is left to take."""
        return self.matcher.is_stopped()

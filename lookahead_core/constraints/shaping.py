"""One request's logits shaped along its accepted tokens: the grammar's mask, min_tokens, logit
bias and penalties (`LogitRules`), in vLLM's order. A step's walk shapes each verified row with the
state its tree path reached, so the output is plain decoding's with the same options."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from lookahead_core.constraints.grammar import GrammarState
from lookahead_core.constraints.logit_rules import LogitRules


class RowShaper:
    """`advance` each token the request takes (in order), `rollback` those a stop rule cut; `shape`
    a row of logits for the next. `end_ids`: the tokens that end the request (EOS and stop ids),
    which min_tokens holds back, and which end it where its grammar allows no token at all (a
    grammar that needs a character the vocabulary cannot write): a grammar needs one."""

    def __init__(self, rules: LogitRules | None, grammar: GrammarState | None, prompt: Iterable[int],
                 end_ids: Iterable[int], vocab_size: int) -> None:
        self.rules = rules if rules is not None and rules.active else None
        self.grammar = grammar
        self.produced = 0
        self._taken: list[tuple[int, bool, bool]] = []  # (token, first seen, the grammar took it), for rollback
        ends = sorted(end_ids)
        if grammar is not None and not ends:
            raise ValueError("a request with a grammar needs an end token (EOS or a stop token id) to end on")
        self._ends = torch.tensor(ends, dtype=torch.int64)
        self._end_set = frozenset(ends)
        r = self.rules
        self._seen = self._counts = None
        self._end = self._bias_ids = self._bias = None
        if r is not None:
            if r.repetition_penalty != 1.0:
                self._seen = torch.zeros(vocab_size, dtype=torch.bool)
                self._seen[torch.tensor(list(prompt), dtype=torch.int64)] = True
            if r.presence_penalty or r.frequency_penalty:
                self._counts = torch.zeros(vocab_size, dtype=torch.float32)
            if r.min_tokens:
                self._end = self._ends
            if r.logit_bias:
                self._bias_ids = torch.tensor([t for t, _ in r.logit_bias], dtype=torch.int64)
                self._bias = torch.tensor([b for _, b in r.logit_bias], dtype=torch.float32)

    def shape(self, row: torch.Tensor) -> torch.Tensor:
        """A float32 copy of `row` [V] as the request's options and state leave it."""
        z = row.float().clone()
        if self.grammar is not None:
            self.grammar.mask_(z)
            if not torch.isfinite(z).any():  # no token continues the grammar: the request ends
                z[self._ends] = row[self._ends].float()
        r = self.rules
        if r is None:
            return z
        if self._end is not None and self.produced < r.min_tokens and self._end.numel():
            held = z[self._end].clone()
            z[self._end] = -torch.inf
            if self.grammar is not None and not torch.isfinite(z).any():
                z[self._end] = held  # the grammar allows nothing but an end: the grammar wins
        if self._bias is not None:
            z[self._bias_ids] += self._bias
        if self._seen is not None:
            p = r.repetition_penalty
            seen = z[self._seen]
            z[self._seen] = torch.where(seen < 0, seen * p, seen / p)
        if self._counts is not None:
            c = self._counts
            z -= r.frequency_penalty * c + r.presence_penalty * (c > 0).float()
        return z

    def argmax(self, row: torch.Tensor) -> int:
        """The token greedy decoding takes from `row` [V] shaped: under a grammar alone, the row's
        own argmax where the grammar takes it (the shaped row's argmax then), else the shaped row's."""
        if self.rules is None and self.grammar is not None:
            top = int(row.argmax())
            if self.grammar.allows(top):
                return top
        return int(self.shape(row).argmax())

    def advance(self, token: int) -> int:
        """Take `token` (returned), or an end token where the grammar refuses it: a dead end, or a
        token its mask admitted that the matcher then refuses (a vocabulary whose bytes mislead it)."""
        took = self.grammar is not None and self.grammar.valid_prefix([token]) == 1
        if self.grammar is not None and not took and token not in self._end_set:
            token = int(self._ends[0])
            took = self.grammar.valid_prefix([token]) == 1
        if took:
            self.grammar.advance(token)  # type: ignore[union-attr]
        first = False
        if self._seen is not None:
            first = not bool(self._seen[token])
            self._seen[token] = True
        if self._counts is not None:
            self._counts[token] += 1
        self._taken.append((token, first, took))
        self.produced += 1
        return token

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if self.grammar is not None:
            self.grammar.rollback(sum(took for _, _, took in self._taken[-n:]))
        for token, first, _ in self._taken[-n:]:
            if first and self._seen is not None:
                self._seen[token] = False
            if self._counts is not None:
                self._counts[token] -= 1
        del self._taken[-n:]
        self.produced -= n

"""The compiled unit: one decode step (or one prompt chunk) of the model over the KV slot tensors.
This module, `SlotCache` and the attention patch are the only code a graph traces; a package's
name digests their source (`GRAPH_SOURCE`), docstrings and comments left out."""
from __future__ import annotations

from collections.abc import Callable

import torch

from lookahead_core.engine.graphs import attention, slot_cache
from lookahead_core.engine.graphs.slot_cache import SlotCache, kv_pairs
from lookahead_core.engine.graphs.source_digest import source_digest
from lookahead_core.engine.runner import fused_projections
from lookahead_core.engine.runner.weights import PackedLinear

Step = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def decode_step(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cols: torch.Tensor,
                rows: torch.Tensor, kv: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, T, V], greedy next token [B, T]) of rows [0, B), each token written at its column."""
    cache = SlotCache(kv_pairs(kv), rows, cols, mask.shape[-1])
    logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True).logits
    return logits, logits.argmax(dim=-1)


def prefill_step(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cols: torch.Tensor,
                 rows: torch.Tensor, kv: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt chunk of the one slot in `rows`: the last row's logits only (no other row's are read
    when a prompt is prefilled without its logprobs)."""
    cache = SlotCache(kv_pairs(kv), rows, cols, mask.shape[-1], gather=True)
    logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True,
                   logits_to_keep=1).logits
    return logits, logits.argmax(dim=-1)


class StepModule(torch.nn.Module):
    """A step as a module for export: the model a submodule (its weights the graph's constants,
    supplied at load), the KV slot tensors inputs written in place."""

    def __init__(self, model: torch.nn.Module, step: Step) -> None:
        super().__init__()
        self.model, self.step = model, step

    def forward(self, ids, pos, mask, cols, rows, kv: list[torch.Tensor]):
        return self.step(self.model, ids, pos, mask, cols, rows, kv)


def constants(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A step module's parameters and buffers by the names its graph's constants have."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    return out


GRAPH_SOURCE = source_digest(decode_step, prefill_step, StepModule, slot_cache, attention, PackedLinear,
                             fused_projections)

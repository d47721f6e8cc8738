"""One forward of a Hugging Face causal LM through its public interface."""
from __future__ import annotations

import inspect
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lookahead_core.engine.bucket_staging import Bucket
from lookahead_core.engine.compiled_forward import CompiledForward
from lookahead_core.engine.step_costs import StepCosts
from lookahead_core.engine.step_threads import StepThreads
from lookahead_core.lookahead.layout import StepLayout
from lookahead_core.lookahead.params import LookaheadParams


def eager_decode(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                 cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The uncompiled decode forward: (greedy next token [B, T], logits [B, T, V])."""
    logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, past_key_values=cache,
                   use_cache=True).logits
    return logits.argmax(dim=-1), logits


class ModelRunner:
    """Holds a causal LM and calls it with explicit positions, a 4D float mask and a cache; owns
    the decode forward's compiled graphs (`graphs`, set once they are built) and learns what its
    decode forwards cost (`costs`)."""

    def __init__(self, model: torch.nn.Module, costs: StepCosts | None = None, max_layouts: int = 32,
                 threads: StepThreads | None = None) -> None:
        self.model = model
        self.costs = costs or StepCosts()
        self.threads = threads  # torch threads per forward by its batch; None: the process's, untouched
        self.graphs: CompiledForward | None = None
        self.eager_forwards = 0  # decode forwards no graph held (or whose graph raised)
        self._ready: set[Bucket] = set()  # compiled buckets whose readiness `costs` has been told of
        self._ready_changes = 0
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        config: Any = model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = int(config.num_hidden_layers)
        self.vocab_size = int(config.vocab_size)
        self.context_length = getattr(config, "max_position_embeddings", None)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        self.kv_bytes_per_token = self.num_layers * 2 * kv_heads * head_dim * self.dtype.itemsize
        self.sliding_window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.generation_config = getattr(model, "generation_config", None)
        # Clients choose (N, W, G) per request, so the layouts kept are bounded (least recently used out).
        self._layouts: OrderedDict[LookaheadParams | None, StepLayout] = OrderedDict()
        self.max_layouts = max_layouts

    def layout(self, params: LookaheadParams | None) -> StepLayout:
        """The step layout for `params`, built once per (N, W, G, tree rows) on this model's dtype and
        device while in use; a sequence keeps its own reference."""
        key = None if params is None else LookaheadParams(params.n, params.w, params.g, lookup=params.lookup,
                                                          successors=params.successors)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = StepLayout(key, self.dtype, self.device)
            while len(self._layouts) > self.max_layouts:
                self._layouts.popitem(last=False)
        self._layouts.move_to_end(key)
        return lay

    def check_tokens(self, tokens: Sequence[int], top_logprobs: int = 0) -> None:
        """Token ids, and the logprobs asked per token, within the vocabulary."""
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {self.vocab_size})")
        if top_logprobs > self.vocab_size:
            raise ValueError(f"{top_logprobs} logprobs per token exceed the model's vocabulary of {self.vocab_size} tokens")

    def check_length(self, total_tokens: int) -> None:
        if self.context_length is not None and total_tokens > self.context_length:
            raise ValueError(
                f"prompt plus max_new_tokens is {total_tokens} tokens, beyond the model's context "
                f"length of {self.context_length}"
            )
        if self.sliding_window is not None and total_tokens > self.sliding_window:
            raise ValueError(
                f"prompt plus max_new_tokens is {total_tokens} tokens, beyond the model's sliding "
                f"window of {self.sliding_window}; sliding-window masks are not supported yet"
            )

    def prefill(self, input_ids: torch.Tensor, start: int, cache, mask: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Write the keys of `input_ids` [B, T] at positions start.. into the cache; logits [B, T', V]
        whose last row follows the last token (every row with `all_logits`, for prompt logprobs).
        Without `mask` the model applies its causal mask. A chunk a ready graph holds runs in it:
        the prefill graph (any slot; it computes the last row's logits only), else, for the cache's
        first slot (a request that arrives alone), a batch-1 decode graph (every row's, which
        `all_logits` needs)."""
        positions = torch.arange(start, start + input_ids.shape[1], device=self.device).unsqueeze(0)
        if self.threads is not None:
            self.threads.use(input_ids.shape[0], prefill=True)
        graphs = self.graphs
        if graphs is not None and mask is not None and input_ids.shape[0] == 1:
            width, kv_len = input_ids.shape[1], mask.shape[-1]
            bucket = (graphs.can_run(1, width, kv_len, cache) if all_logits
                      else graphs.can_prefill(width, kv_len, cache) or graphs.can_run(1, width, kv_len, cache))
            out = None if bucket is None else graphs.replay(bucket, input_ids, positions, mask, cache)
            if out is not None:
                return out[1]
        kwargs = {"logits_to_keep": 0 if all_logits else 1} if self._takes_logits_to_keep else {}
        return self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                          use_cache=True, **kwargs).logits

    def decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache,
               topk: int = 0) -> tuple[np.ndarray, torch.Tensor]:
        """(greedy next token after every input position [B, T], then with `topk` its k likeliest
        [B, T, 1 + k]; logits [B, T, V]). The tokens reach the host in one transfer, the step's one
        sync; sampling reads the logits rows it needs. In the graph that holds the step, else
        eagerly; a graph that raises is dropped and the step runs eagerly."""
        compiled = self.graphs
        if compiled is not None and compiled.ready_changes != self._ready_changes:
            # a bucket that just finished compiling (or failed): its batch's timings price the
            # path its steps took before, not the one they take now; what the ready graphs cost
            # alone prices the widths not yet run on it
            self._ready_changes = compiled.ready_changes
            ready = set(compiled.ready)
            for changed in ready ^ self._ready:
                self.costs.forget(changed.batch)
            self._ready = ready
            self.costs.calibrate(compiled.alone_costs())
        if self.threads is not None:
            self.threads.use(input_ids.shape[0])
        t0 = time.perf_counter()
        out = None
        if compiled is not None:
            bucket = compiled.can_run(input_ids.shape[0], input_ids.shape[1], mask.shape[-1], cache)
            out = None if bucket is None else compiled.replay(bucket, input_ids, position_ids, mask, cache)
        if out is None:
            self.eager_forwards += 1
            out = eager_decode(self.model, input_ids, position_ids, mask, cache)
        pred, logits = out
        if topk:  # argmax stays the greedy token: topk's order among equal logits is not argmax's
            pred = torch.cat([pred.unsqueeze(-1), logits.topk(topk, dim=-1, sorted=True).indices], dim=-1)
        tokens = pred.cpu().numpy()
        self.costs.observe(input_ids.shape[0], input_ids.shape[1], (time.perf_counter() - t0) * 1000.0)
        return tokens, logits

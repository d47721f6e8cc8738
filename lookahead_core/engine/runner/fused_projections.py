"""Projections that read one input fused into one linear layer: an attention's query, key and value,
an MLP's gate and up. At a decode step's few rows a GEMM costs its call as much as its weight's
bytes, so three small calls cost more than one over their concatenated weights; each output is
computed by the same dot products as before.

Only the module classes whose forward is known to be Llama's are fused (`ATTENTION`, `GATED_MLP`);
others keep their own projections.
"""
from __future__ import annotations

import sys
from types import MethodType

import torch
from torch import nn

# attention modules whose forward is LlamaAttention's (checked against transformers in the tests)
ATTENTION = ("LlamaAttention", "GemmaAttention")
# MLP modules computing down(act(gate(x)) * up(x))
GATED_MLP = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "GemmaMLP")


def fused_linear(parts: list[nn.Linear], copy: bool) -> nn.Linear:
    """One linear layer whose outputs are `parts`' outputs in order (`copy` False: its weight
    uninitialised, for a model whose values do not matter)."""
    first = parts[0].weight
    out = sum(p.out_features for p in parts)
    bias = all(p.bias is not None for p in parts)
    if not bias and any(p.bias is not None for p in parts):
        raise ValueError("fusing projections some of which have a bias and some not")
    fused = nn.Linear(parts[0].in_features, out, bias=bias, device="meta", dtype=first.dtype)
    fused.to_empty(device=first.device)  # no initialisation: every value is written below, or never read
    fused.requires_grad_(False)
    if copy:
        with torch.no_grad():
            torch.cat([p.weight for p in parts], out=fused.weight)
            if bias:
                torch.cat([p.bias for p in parts], out=fused.bias)
    return fused


def fused_attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                            cache=None, past_key_values=None, **kwargs):
    """LlamaAttention's forward over one query-key-value projection (`qkv_proj`, split by `qkv_sizes`)."""
    cache = cache if cache is not None else past_key_values
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
    query_states = q.view(hidden_shape).transpose(1, 2)
    key_states = k.view(hidden_shape).transpose(1, 2)
    value_states = v.view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = self.rotary(query_states, key_states, cos, sin)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
    attention = self.attention_functions.get_interface(self.config._attn_implementation, self.eager_attention)
    attn_output, attn_weights = attention(self, query_states, key_states, value_states, attention_mask,
                                          dropout=0.0 if not self.training else self.attention_dropout,
                                          scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def gated_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) over one gate-up projection (`gate_up_proj`)."""
    gate, up = self.gate_up_proj(x).split(self.gate_up_sizes, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def _projections(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    linears = [p for p in (getattr(module, n, None) for n in names) if isinstance(p, nn.Linear)]
    return linears if len(linears) == len(names) else None


def _fuse(module: nn.Module, names: tuple[str, ...], fused_name: str, forward, copy: bool) -> bool:
    """`module`'s projections `names` as one layer `fused_name` (its split sizes beside it), and
    `forward` as the module's."""
    parts = _projections(module, names)
    if parts is None:
        return False
    setattr(module, fused_name, fused_linear(parts, copy))
    setattr(module, fused_name.removesuffix("_proj") + "_sizes", [p.out_features for p in parts])
    for n in names:
        delattr(module, n)
    module.forward = MethodType(forward, module)  # type: ignore[method-assign]
    return True


def fuse_projections(model: nn.Module, copy: bool = True) -> int:
    """Fuse each supported attention's and MLP's projections in place; returns the modules fused."""
    fused = 0
    for module in model.modules():
        name = type(module).__name__
        if name in ATTENTION and _projections(module, ("q_proj", "k_proj", "v_proj", "o_proj")) is not None:
            source = sys.modules[type(module).__module__]  # the model's own rotary and attention functions
            module.rotary = source.apply_rotary_pos_emb
            module.attention_functions = source.ALL_ATTENTION_FUNCTIONS
            module.eager_attention = source.eager_attention_forward
            fused += _fuse(module, ("q_proj", "k_proj", "v_proj"), "qkv_proj", fused_attention_forward, copy)
        elif name in GATED_MLP and _projections(module, ("gate_proj", "up_proj", "down_proj")) is not None:
            fused += _fuse(module, ("gate_proj", "up_proj"), "gate_up_proj", gated_mlp_forward, copy)
    return fused

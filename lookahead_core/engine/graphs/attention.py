"""The one process-wide patch of another library: grouped-query attention as compiled CPU graphs
trace it. Installed once by the code that exports a graph; eager forwards keep transformers' own
path, since the patch acts only while `tracing()` is entered on the calling thread."""
from __future__ import annotations

import contextlib
import threading

import torch
from transformers.integrations import sdpa_attention
from transformers.modeling_utils import AttentionInterface

_TRACE = threading.local()


@contextlib.contextmanager
def tracing():
    """This thread traces a graph: grouped-query attention takes the graph's form inside."""
    _TRACE.active = True
    try:
        yield
    finally:
        _TRACE.active = False


def in_trace() -> bool:
    return getattr(_TRACE, "active", False)


def packed_gqa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                         n_rep: int, scale: float | None) -> torch.Tensor:
    """Grouped-query attention with each key/value head's `n_rep` query heads packed into its query
    rows: query [B, H, T, D] as [B, H / n_rep, n_rep * T, D] against unrepeated keys and values, the
    mask [B, 1, T, K] repeated per packed head. Returns [B, T, H, D], as transformers' attention
    functions do."""
    b, h, t, d = query.shape
    k = mask.shape[-1]
    packed_mask = mask[:, :, None].expand(b, 1, n_rep, t, k).reshape(b, 1, n_rep * t, k)
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, h // n_rep, n_rep * t, d), key, value,
                                                           attn_mask=packed_mask, scale=scale)
    return out.reshape(b, h, t, d).transpose(1, 2).contiguous()


def install_sdpa_gqa() -> None:
    """Grouped-query attention in traced CPU graphs without `repeat_kv`, which copies the attended
    keys and values once per query head group in every layer. Process-wide, once.

    - float32: SDPA's own grouped-query path (`enable_gqa`); transformers takes it on CPU only
      without a mask, and the CPU kernels take a mask with it.
    - bfloat16 and float16: the query heads packed into rows (`packed_gqa_attention`): the CPU
      flash kernel's reduced-precision path costs per (batch, head) pair with `enable_gqa`."""
    if getattr(sdpa_attention.use_gqa_in_sdpa, "_lookahead_gqa", False):
        return
    original = sdpa_attention.use_gqa_in_sdpa

    def use_gqa(attention_mask, key, value):  # CUDA's fused kernels refuse enable_gqa with a mask
        return (in_trace() and key.device.type == "cpu") or original(attention_mask, key, value)

    forward = AttentionInterface._global_mapping["sdpa"]

    def sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        n_rep = getattr(module, "num_key_value_groups", 1)
        if (n_rep > 1 and in_trace() and query.device.type == "cpu"
                and query.dtype in (torch.bfloat16, torch.float16) and attention_mask is not None
                and attention_mask.dim() == 4 and attention_mask.shape[1] == 1 and not dropout
                and kwargs.get("position_bias") is None and kwargs.get("softcap") is None):
            return packed_gqa_attention(query, key, value, attention_mask, n_rep, scaling), None
        return forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, **kwargs)

    use_gqa._lookahead_gqa = True  # type: ignore[attr-defined]
    sdpa_attention.use_gqa_in_sdpa = use_gqa
    AttentionInterface.register("sdpa", sdpa_forward)

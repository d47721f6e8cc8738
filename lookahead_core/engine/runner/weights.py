"""The one copy of a model's weights, laid out for the GEMM kernel that reads it in every forward.

Every forward of the process, eager and each compiled graph, reads the same weight tensors: the
graphs are compiled without their constants and loaded against these (graphs/package_store.py).
A linear layer's weight is laid out once, at load, for the kernel that streams it fastest at every
step width:

- "transposed" (float32 on CPU): stored as [in, out], the parameter a transposed view of it, so
  every linear is MKL's plain GEMM over contiguous rows;
- "onednn" (bfloat16 and float16 on CPU): packed once into oneDNN's blocked layout
  (`PackedLinear`);
- "plain": as loaded (CUDA).

On CPU the projections that read one input are first fused into one layer
(`fused_projections.py`: query-key-value, gate-up), each output the same dot product as before.
A tied output head shares the embedding's tensor where the layout keeps it a view ("transposed",
"plain"); packed, it gets a packed copy of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lookahead_core.engine.runner.fused_projections import fuse_projections

WeightLayout = Literal["auto", "plain", "transposed", "onednn"]
LAYOUTS = ("plain", "transposed", "onednn")
# oneDNN picks its blocked format for a row count; one format serves every step width
PACK_ROWS = 16
_OWNED = "_lookahead_owned"


class PackedLinear(nn.Module):
    """A linear layer over a weight packed once in oneDNN's blocked layout (a parameter, so that a
    graph exported over it takes it as one of its constants)."""

    def __init__(self, linear: nn.Linear, rows: int = PACK_ROWS) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        self.packed = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def resolve_layout(layout: WeightLayout, device: torch.device, dtype: torch.dtype) -> str:
    """"auto": "transposed" for float32 on CPU, "onednn" for bf16/fp16 on CPU where oneDNN is
    built in, "plain" elsewhere."""
    if layout != "auto":
        if layout not in LAYOUTS:
            raise ValueError(f"weight layout {layout!r}: choose from auto, {', '.join(LAYOUTS)}")
        if layout != "plain" and device.type != "cpu":
            raise ValueError(f"weight layout {layout!r} is for CPU; a {device.type} model keeps \"plain\"")
        if layout == "onednn" and not torch.backends.mkldnn.is_available():
            raise ValueError("weight layout \"onednn\" needs a torch built with oneDNN (mkldnn)")
        return layout
    if device.type != "cpu":
        return "plain"
    if dtype == torch.float32:
        return "transposed"
    return "onednn" if torch.backends.mkldnn.is_available() else "plain"


@dataclass(frozen=True)
class WeightsInfo:
    """What the weights hold in memory, once each."""

    layout: str
    bytes: int  # every parameter and buffer, a tensor shared by several counted once
    linear_layers: int

    def as_dict(self) -> dict:
        return {"layout": self.layout, "bytes": self.bytes, "mib": round(self.bytes / 2**20, 1),
                "linear_layers": self.linear_layers}


def _linears(model: nn.Module):
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                yield parent, name, child


def apply_layout(model: nn.Module, layout: str, copy: bool = True) -> WeightsInfo:
    """Lay out every linear layer's weight for `layout`, in place; the old tensors are released.
    Without `copy` a "transposed" weight is a new uninitialised tensor of the layout (a model
    whose values do not matter: a compile worker's)."""
    count = 0
    if layout in ("transposed", "onednn"):
        fuse_projections(model, copy)
    if layout == "transposed":
        # a tied weight is laid out once, for all that hold it (the old one kept here: its id stays its own)
        done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        for _, _, linear in _linears(model):
            count += 1
            weight = linear.weight
            if id(weight) not in done:
                data = weight.detach()
                if data.stride() != (1, data.shape[0]):  # not already [in, out] storage
                    data = data.t().contiguous().t() if copy else torch.empty(
                        data.shape[::-1], dtype=data.dtype, device=data.device).t()
                done[id(weight)] = (weight, nn.Parameter(data, requires_grad=False))
            linear.weight = done[id(weight)][1]
        # modules that held the old tensor beside a linear (a tied embedding) take the new one
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) in done and param is done[id(param)][0]:
                    setattr(module, name, done[id(param)][1])
        done.clear()
    elif layout == "onednn":
        for parent, name, linear in list(_linears(model)):
            count += 1
            setattr(parent, name, PackedLinear(linear))
    elif layout != "plain":
        raise ValueError(f"unknown weight layout {layout!r}")
    if layout == "plain":
        count = sum(1 for _ in _linears(model))
    elif copy:
        laid_out = {id(p) for p in model.parameters() if p.is_mkldnn or _transposed(p)}
        _own_storage(model, laid_out)
    return WeightsInfo(layout, weight_bytes(model), count)


def tensor_bytes(t: torch.Tensor) -> int:
    if t.is_mkldnn:
        return int(torch.ops.mkldnn._nbytes(t))
    return t.untyped_storage().nbytes()


def _own_storage(model: nn.Module, laid_out: set[int]) -> None:
    """Every other tensor copied out of what it was loaded in: a loader that maps the checkpoint
    file backs each tensor by that one mapping, and a small norm weight left in it keeps the whole
    file's pages resident beside the laid-out copy."""
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if id(t) not in laid_out and not t.is_mkldnn and t.device.type == "cpu" and not getattr(t, _OWNED, False):
                t.data = t.data.clone(memory_format=torch.preserve_format)
                setattr(t, _OWNED, True)  # laid out again (another runner over the model), kept as it is


def _transposed(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride() == (1, t.shape[0]) and t.shape[0] > 1


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        key = id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor_bytes(t)
    return total

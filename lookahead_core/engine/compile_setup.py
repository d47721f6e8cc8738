"""Process-wide settings and helpers around inductor compiles of the decode step: its options,
SDPA's grouped-query path in traces, quiet autotuning, recompile limits, the weights' tag that
keys compiled graphs on disk, and the throttle that keeps a background compile from starving the engine thread."""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters
from torch._inductor import select_algorithm
from transformers.integrations import sdpa_attention
from transformers.modeling_utils import AttentionInterface


def packed_gqa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                         n_rep: int, scale: float | None) -> torch.Tensor:
    """Grouped-query attention with each key/value head's `n_rep` query heads packed into its query
    rows: query [B, H, T, D] as [B, H / n_rep, n_rep * T, D] against unrepeated keys and values, the
    mask [B, 1, T, K] repeated per packed head. transformers packs so for one query in eager
    forwards (`pack_gqa`); this is its form for any T. Returns [B, T, H, D], as transformers'
    attention functions do."""
    b, h, t, d = query.shape
    k = mask.shape[-1]
    packed_mask = mask[:, :, None].expand(b, 1, n_rep, t, k).reshape(b, 1, n_rep * t, k)
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, h // n_rep, n_rep * t, d), key, value,
                                                           attn_mask=packed_mask, scale=scale)
    return out.reshape(b, h, t, d).transpose(1, 2).contiguous()


def install_sdpa_gqa() -> None:
    """Grouped-query attention in compiled CPU graphs without `repeat_kv`, which copies the attended
    keys and values once per query head group in every layer. Process-wide, once; eager forwards
    keep transformers' own path on any thread.

    - float32: SDPA's own grouped-query path (`enable_gqa`). transformers decides per call in
      `use_gqa_in_sdpa` (on CPU: only without a mask); the CPU kernels take a mask with
      `enable_gqa`. The decision is replaced by one that says yes in a dynamo trace on CPU.
    - bfloat16 and float16: the query heads packed into rows (`packed_gqa_attention`), in place
      of transformers' "sdpa" attention function inside traces. The CPU flash kernel's reduced-
      precision path costs per (batch, head) pair: with `enable_gqa` a one-token step at batch 16
      took 5.9x the packed form's time (3.4 ms against 0.59 ms a layer, 220 keys, one thread).

    "In a dynamo trace" is `is_dynamo_compiling` (folded to True in a trace, False in eager), not
    `is_compiling`, which in torch 2.13 is one process-wide flag held for a whole compile: with
    it, eager steps on the engine thread took the compiled arithmetic while a bucket compiled in
    the background. transformers' attention reads that flag too (its one-query `pack_gqa`), so
    its module gets the per-trace test as well."""
    if getattr(sdpa_attention.use_gqa_in_sdpa, "_lookahead_gqa", False):
        return
    original = sdpa_attention.use_gqa_in_sdpa

    def use_gqa(attention_mask, key, value):  # CUDA's fused kernels refuse enable_gqa with a mask
        return (torch.compiler.is_dynamo_compiling() and key.device.type == "cpu") or original(attention_mask, key, value)

    forward = AttentionInterface._global_mapping["sdpa"]

    def sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        n_rep = getattr(module, "num_key_value_groups", 1)
        if (n_rep > 1 and torch.compiler.is_dynamo_compiling() and query.device.type == "cpu"
                and query.dtype in (torch.bfloat16, torch.float16) and attention_mask is not None
                and attention_mask.dim() == 4 and attention_mask.shape[1] == 1 and not dropout
                and kwargs.get("position_bias") is None and kwargs.get("softcap") is None):
            return packed_gqa_attention(query, key, value, attention_mask, n_rep, scaling), None
        return forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, **kwargs)

    use_gqa._lookahead_gqa = True  # type: ignore[attr-defined]
    sdpa_attention.use_gqa_in_sdpa = use_gqa
    sdpa_attention.is_torchdynamo_compiling = torch.compiler.is_dynamo_compiling  # type: ignore[attr-defined]
    AttentionInterface.register("sdpa", sdpa_forward)


def quiet_autotune() -> None:
    """Inductor prints every GEMM's autotuning table to stderr (about a hundred lines a bucket);
    the compile logs one line per bucket instead. Process-wide, as inductor's switch is."""
    select_algorithm.PRINT_AUTOTUNE = False


def weights_tag(model: torch.nn.Module) -> str:
    """A digest of the model's parameters and buffers (names, dtypes, shapes and bytes): the cache
    key tag of its compiled graphs, so no model loads a graph holding another's packed weights."""
    digest = hashlib.blake2b(digest_size=16)
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        t = t.detach()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.to("cpu").contiguous().view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


@contextlib.contextmanager
def compiling(options: dict, tag: str):
    """Inductor's `options` and the cache key `tag` around one compile; yields a list that gets
    True when the compile loaded its graph from the on-disk cache."""
    hits = counters["inductor"]["fxgraph_cache_hit"]
    loaded: list[bool] = []
    tagged = torch.compiler.config.patch(cache_key_tag=tag)  # type: ignore[attr-defined]
    with torch._inductor.config.patch(**options), tagged:
        yield loaded
    loaded.append(counters["inductor"]["fxgraph_cache_hit"] > hits)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's `malloc_trim`): a compile frees much of
    what it allocated and glibc keeps freed pages resident (SmolLM2 in float32, bucket (1, 1):
    1,796 MB resident after its compile without this, 1,612 MB with it)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def inductor_options(cuda: bool, gemm_autotune: bool = True, template_only: bool = False) -> dict:
    """Inductor settings for a decode graph, set around its compile. On CPU: freezing (weights
    folded into constants and packed once) and, with `gemm_autotune`, every linear layer timed at
    its own shape between inductor's C++ micro-GEMM template and the packed MKL kernel
    (`max_autotune`, backends CPP and ATEN): on a 2-core AVX2 EPYC, MKL took 1.5x its one-row time
    for two rows and the template 1.06x. `template_only` (a graph of 3 or 4 rows,
    `Bucket.template_gemms`): the template only.
    On CUDA: nothing (CUDA graphs come from the mode)."""
    if cuda:
        return {}
    options: dict = {"freezing": True}
    if gemm_autotune:
        # the choices' stats go to stderr per GEMM otherwise (quiet_autotune silences the tables)
        options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN", max_autotune_report_choices_stats=False)
        if template_only:
            # At 3 and 4 rows oneDNN won the isolated timing on AVX512 without AMX and ran slower
            # than the template inside the forward (the weights streamed from memory, not cached).
            options["max_autotune_gemm_backends"] = "CPP"
    return options


class CompileThrottle:
    """`sys.settrace` hook for a background compile thread: while `owner.busy` (the engine has
    requests) the thread runs `share` of the time, in turns of `slice_s`, and sleeps at a Python
    call in between; 0 makes it wait until the engine is idle. The hook costs a Python call per
    call of the compile whether the engine is busy or not (a graph loaded from the on-disk cache
    took 1.7-1.9x as long with it, the engine idle), so the thread `attach`es it at each graph it
    starts, only while the engine has requests then.

    Compiling is Python and holds the GIL; each op of an eager step beside it waits up to the
    switch interval for it (a forward beside a busy Python thread runs many times slower, whatever
    the interval), so it must yield; but a replica that is never idle
    still gets its compiled steps. An engine that stops stepping (`owner.beat` unchanged for 1 s)
    may wait on a lock this thread holds (logging, an import): then the compile runs on until the
    engine steps again.
    """

    def __init__(self, owner, share: float, slice_s: float = 0.05) -> None:
        self.owner, self.slice_s = owner, slice_s
        self.rest_s = slice_s * (1 - share) / share if share > 0 else float("inf")
        self.turn_start = 0.0
        self.stuck = -1

    def attach(self) -> None:
        """Trace the calling thread with this throttle while the engine has requests, else not."""
        sys.settrace(self if self.owner.busy else None)

    def __call__(self, frame, event, arg) -> None:
        owner = self.owner
        if not owner.busy or owner.beat == self.stuck:
            return
        now = time.monotonic()
        if now - self.turn_start < self.slice_s:
            return
        last, since, until = owner.beat, now, now + self.rest_s
        while owner.busy and time.monotonic() < until:
            time.sleep(0.002)
            if owner.beat != last:
                last, since = owner.beat, time.monotonic()
            elif time.monotonic() - since > 1.0:
                self.stuck = last
                break
        self.turn_start = time.monotonic()


def recompile_limit(graphs: int) -> dict:
    """torch.compile's keywords that let one function hold `graphs` graphs: its own limit where
    torch takes one (2.13), else the process-wide limit raised to it."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return {"isolate_recompiles": True, "recompile_limit": graphs}
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, graphs)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * graphs)
    return {}


def start_low_priority(name: str, work: Callable[[], None], cores: frozenset[int] | None = None) -> threading.Thread:
    """Run `work` on a daemon thread at the lowest priority (it paces itself: `CompileThrottle`),
    on `cores` where given (a thread inherits its creator's cores: the engine's may be bound to fewer)."""

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):  # the compiler's subprocesses too
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            if cores:
                os.sched_setaffinity(0, cores)  # this thread only, and what it starts
        work()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread

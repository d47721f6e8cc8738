"""The engine's memory, planned before anything is allocated: how many KV slots fit a budget (as
vLLM's gpu_memory_utilization does), and what the process holds beside them."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` now: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil  # a dependency of ray; only needed for a fractional budget on CPU

    return int(psutil.virtual_memory().available)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's `malloc_trim`): laying weights out frees
    the loaded copy, and glibc keeps freed pages resident."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass(frozen=True)
class KVPlan:
    """The arithmetic behind the engine's slot count, logged at start and shown on /health."""

    slots: int
    capacity_tokens: int  # per slot: max_seq_len + one step's rows
    bytes_per_token: int  # keys and values of every layer
    bytes_per_slot: int  # KV plus the slot's step mask
    budget_bytes: int | None  # None: no budget, max_batch slots
    total_bytes: int  # the slots and the reserved bytes
    reserved_bytes: int = 0  # taken from the budget before the slots (stored prompt prefixes)
    learned_bytes: int = 0  # the replica's learned tables at their largest: host memory beside the KV

    def describe(self) -> str:
        budget = "no budget" if self.budget_bytes is None else f"budget {self.budget_bytes / 2**20:.0f} MiB"
        prefixes = f" + {self.reserved_bytes / 2**20:.0f} MiB of prompt prefixes" if self.reserved_bytes else ""
        learned = f"; learned tables up to {self.learned_bytes / 2**20:.0f} MiB beside it" if self.learned_bytes else ""
        return (f"KV cache: {self.slots} slots x {self.capacity_tokens} tokens x {self.bytes_per_token / 1024:.1f} KiB "
                f"(+ step mask){prefixes} = {self.total_bytes / 2**20:.0f} MiB ({budget}){learned}")

    def as_dict(self) -> dict:
        return asdict(self)


def plan_kv(max_batch: int, capacity: int, bytes_per_token: int, mask_bytes_per_slot: int,
            budget: float | int | None, free_bytes: int | None, reserved_tokens: int = 0,
            learned_bytes: int = 0, learned_in_free: bool = False) -> KVPlan:
    """Fit slots of `capacity` tokens into `budget` (bytes, or a fraction of `free_bytes`), at most
    `max_batch`, after `reserved_tokens` of KV kept outside the slots; raise ValueError when not
    even one fits, or when without a budget `max_batch` slots take more than `free_bytes`.
    `learned_bytes` (the learned tables at their largest) come out of `free_bytes` first where
    `learned_in_free` (the KV is in host memory too); a byte budget is the KV's alone."""
    per_slot = capacity * bytes_per_token + mask_bytes_per_slot
    reserved = reserved_tokens * bytes_per_token
    if free_bytes is not None and learned_in_free:
        if learned_bytes >= free_bytes:
            raise ValueError(
                f"the replica's learned tables can grow to {learned_bytes / 2**20:.1f} MiB but "
                f"{free_bytes / 2**20:.1f} MiB is free; lower engine.history_tokens, engine.shared_pool_keys or "
                f"engine.shared_pool_cap (0 turns the pool off)")
        free_bytes -= learned_bytes
    if budget is None:
        total = max_batch * per_slot + reserved
        if free_bytes is not None and total > free_bytes:
            beside = (f" after {learned_bytes / 2**20:.1f} MiB of learned tables"
                      if learned_in_free and learned_bytes else "")
            raise ValueError(
                f"without an engine.kv_cache_memory budget the KV cache takes max_batch={max_batch} slots of "
                f"{capacity} tokens (max_seq_len, by default the model's context length, plus one step's rows): "
                f"{total / 2**20:.1f} MiB, but {free_bytes / 2**20:.1f} MiB is free{beside}; set "
                f"engine.kv_cache_memory (a fraction such as 0.9 fits the slots to free memory) or lower "
                f"engine.max_seq_len or engine.max_batch")
        return KVPlan(max_batch, capacity, bytes_per_token, per_slot, None, total, reserved, learned_bytes)
    if isinstance(budget, float):
        assert free_bytes is not None, "a fractional KV budget needs free_bytes"
        budget_bytes = int(budget * free_bytes)
    else:
        budget_bytes = int(budget)
    slots = min(max_batch, max(budget_bytes - reserved, 0) // per_slot)
    if slots < 1:
        raise ValueError(
            f"the KV cache budget of {budget_bytes / 2**20:.1f} MiB holds no sequence: one of max_seq_len "
            f"{capacity} tokens (with one step's rows) needs {per_slot / 2**20:.1f} MiB"
            + (f" beside {reserved / 2**20:.1f} MiB of prompt prefixes" if reserved else "")
            + "; raise engine.kv_cache_memory or lower engine.max_seq_len" + (" or engine.prefix_cache_tokens" if reserved else ""))
    return KVPlan(slots, capacity, bytes_per_token, per_slot, budget_bytes, slots * per_slot + reserved, reserved,
                  learned_bytes)


def process_rss() -> int | None:
    """This process's resident bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


# Before a graph is built its code is priced at this (a package's library: the decode step's wrapper and kernels)
GRAPH_CODE_BYTES = 16 * 2**20
# A compile worker's tracing and inductor's work on a decode step, beside the weights' shapes it
# allocates (untouched where their layout needs no copy)
COMPILE_WORKSPACE_BYTES = 3 * 2**30
# oneDNN keeps a primitive per GEMM shape (each row count of each weight shape a step runs) up to
# its cache's capacity, 1024 by default; a packed bf16 GEMM's primitive holds its JIT code and
# buffers (measured with `PackedLinear` over SmolLM2's five weight shapes)
ONEDNN_CACHE_BYTES = 1024 * 192 * 2**10


@dataclass(frozen=True)
class MemoryPlan:
    """What the engine's process holds once every graph is ready, and what must be free beside it:
    counted at start, refused there if it cannot fit, shown on /health."""

    process_bytes: int  # the process when planned: the runtime and the model's one copy of its weights
    weights_bytes: int  # of it, the weights
    kv: KVPlan  # the KV slots, their step masks and the stored prompt prefixes
    buffers_bytes: int  # the step and prefill buffers, the graphs' input buffers
    learned_bytes: int  # the replica's learned tables at their largest
    graphs: int  # compiled graphs
    graph_code_bytes: int  # their code, mapped
    step_peak_bytes: int  # the widest step's outputs: the heap keeps their pages once a step held them
    compile_bytes: int  # per compile worker, beside this process while graphs compile (0: none compiles)
    compile_workers: int
    kernel_cache_bytes: int = 0  # the GEMM library's cached kernels at its capacity (oneDNN's primitives)

    @property
    def steady_bytes(self) -> int:
        """This process's resident set predicted with every graph ready, once it has served steps
        of every shape (the widest step's outputs and the kernels cached for each GEMM shape)."""
        return (self.process_bytes + self.kv.total_bytes + self.buffers_bytes + self.learned_bytes
                + self.graph_code_bytes + self.step_peak_bytes + self.kernel_cache_bytes)

    @property
    def needed_bytes(self) -> int:
        """What must be free at start beside what the process holds already."""
        return self.steady_bytes - self.process_bytes + self.compile_workers * self.compile_bytes

    @property
    def beside_kv_bytes(self) -> int:
        """What must be free beside the KV slots and the learned tables."""
        return self.needed_bytes - self.kv.total_bytes - self.learned_bytes

    def check(self, free_bytes: int | None) -> None:
        """Refuse a plan that cannot fit in `free_bytes` (None: not checked), naming the settings."""
        if free_bytes is None or self.needed_bytes <= free_bytes:
            return
        mib = 2**20
        compiling = (f" + {self.compile_workers} compile worker(s) x {self.compile_bytes / mib:.0f} MiB"
                     if self.compile_bytes else "")
        raise ValueError(
            f"the memory plan does not fit: the KV cache {self.kv.total_bytes / mib:.0f} MiB + buffers "
            f"{self.buffers_bytes / mib:.0f} MiB + learned tables {self.learned_bytes / mib:.0f} MiB + "
            f"{self.graphs} graph(s) {self.graph_code_bytes / mib:.0f} MiB + the widest step's outputs "
            f"{self.step_peak_bytes / mib:.0f} MiB + cached GEMM kernels {self.kernel_cache_bytes / mib:.0f} MiB"
            f"{compiling} need {self.needed_bytes / mib:.0f} MiB, and "
            f"{free_bytes / mib:.0f} MiB is free beside the process's {self.process_bytes / mib:.0f} MiB "
            f"(weights {self.weights_bytes / mib:.0f} MiB); lower engine.kv_cache_memory or engine.max_batch"
            + (", engine.compile_workers, or set engine.compile: off" if self.compile_bytes else ""))

    def as_dict(self) -> dict:
        mib = 2**20
        return {"predicted_rss_mb": round(self.steady_bytes / mib, 1),
                "process_at_start_mb": round(self.process_bytes / mib, 1),
                "weights_mb": round(self.weights_bytes / mib, 1), "kv_cache_mb": round(self.kv.total_bytes / mib, 1),
                "buffers_mb": round(self.buffers_bytes / mib, 1), "learned_tables_mb": round(self.learned_bytes / mib, 1),
                "graphs": self.graphs, "graph_code_mb": round(self.graph_code_bytes / mib, 1),
                "step_peak_mb": round(self.step_peak_bytes / mib, 1),
                "kernel_cache_mb": round(self.kernel_cache_bytes / mib, 1),
                "compile_worker_mb": round(self.compile_bytes / mib, 1), "compile_workers": self.compile_workers}

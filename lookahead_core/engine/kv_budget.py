"""How many sequences fit: KV slots sized from a memory budget, as vLLM's gpu_memory_utilization does."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` now: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil  # a dependency of ray; only needed for a fractional budget on CPU

    return int(psutil.virtual_memory().available)


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

"""Inductor's settings for the graphs, and what a package's build depends on beside the code."""
from __future__ import annotations

import hashlib
import inspect
import platform
import time
from collections.abc import Callable, Iterable
from functools import cache

import torch
import transformers
from torch._inductor import list_mode_options

# Flags of /proc/cpuinfo whose instructions inductor's C++ (built with -march=native) may use
_ISA_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "bmi", "vnni", "vaes", "vpclmul", "gfni", "movbe",
                 "popcnt", "adx", "sha", "lzcnt", "abm")


def aoti_options() -> dict:
    """A CPU graph: its constants left out of the library (supplied at load from the process's
    weights), its kernels' threads read when they run (one graph serves steps on one thread or two)."""
    return {"aot_inductor.package_constants_in_so": False, "cpp.dynamic_threads": True}


def isa_description(capability: str, machine: str, vec_isa: str, amx_tiles: bool, flags: Iterable[str]) -> str:
    """An instruction set as a build key holds it: torch's capability, the vector ISA inductor
    picks, whether AMX tiles run, and the cpuinfo flags that -march=native turns on (two hosts of
    one capability can differ in AMX or AVX512-BF16, and a kernel built for one dies on the other)."""
    chosen = sorted({w for w in flags if w.startswith(_ISA_PREFIXES)})
    digest = hashlib.blake2b(" ".join([vec_isa, f"amx={amx_tiles}", *chosen]).encode(), digest_size=4).hexdigest()
    return f"{capability}-{machine}-{digest}"


def _vec_isa() -> str:
    try:  # inductor's pick: a test build with this host's compiler, cached by inductor
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        return str(pick_vec_isa())
    except Exception:  # another torch's layout
        return "unknown"


@cache
def instruction_set() -> str:
    """This host's instruction set, as inductor's compiled kernels use it (`isa_description`)."""
    flags: list[str] = []
    if platform.system() == "Linux":
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((ln for ln in f if ln.startswith("flags")), "").split(":", 1)[-1].split()
        except OSError:
            pass
    return isa_description(torch.backends.cpu.get_cpu_capability(), platform.machine(), _vec_isa(),
                           torch.cpu._is_amx_tile_supported(), flags)


def build_key(source: str) -> tuple[str, ...]:
    """What a package's code depends on beside its shape: the traced source, the libraries, the host."""
    return (source, torch.__version__, transformers.__version__, instruction_set())


def recompile_limit(graphs: int) -> dict:
    """torch.compile's keywords that let one function hold `graphs` graphs (CUDA graphs): its own
    limit where torch takes one, else the process-wide limit raised to it."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return {"isolate_recompiles": True, "recompile_limit": graphs}
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, graphs)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * graphs)
    return {}


def compile_cuda_graph(step: torch.nn.Module, staging, bucket, kv: list[torch.Tensor],
                       graphs: int) -> tuple[float, Callable[[list], list]]:
    """CUDA graphs of one fixed shape: `torch.compile` with "reduce-overhead", on this thread, run
    once at the bucket's shape; (seconds, the run)."""
    options = {**list_mode_options("reduce-overhead"),
               "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    compiled = torch.compile(step, fullgraph=True, dynamic=False, options=options, **recompile_limit(graphs))
    for x in kv:
        torch._dynamo.mark_static_address(x)

    def run(inputs: list) -> list:
        torch.compiler.cudagraph_mark_step_begin()
        return list(compiled(*inputs[:5], inputs[5:]))

    t0 = time.perf_counter()
    staging.pad(bucket.batch, bucket.width, bucket.kv)
    with torch.inference_mode():
        run(staging.inputs())
    return time.perf_counter() - t0, run

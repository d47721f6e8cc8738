"""Inductor's settings for the graphs, and what a package's build depends on beside the code."""
from __future__ import annotations

import hashlib
import inspect
import platform
import time
from collections.abc import Callable
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


@cache
def instruction_set() -> str:
    """The instruction set this host's compiled kernels may use: torch's capability and the
    cpuinfo flags that -march=native turns on (two hosts of one capability can differ in AMX or
    AVX512-BF16, and a kernel built for one dies on the other)."""
    flags: list[str] = []
    if platform.system() == "Linux":
        try:
            with open("/proc/cpuinfo") as f:
                line = next((ln for ln in f if ln.startswith("flags")), "")
            flags = sorted({w for w in line.split(":", 1)[-1].split() if w.startswith(_ISA_PREFIXES)})
        except OSError:
            pass
    digest = hashlib.blake2b(" ".join(flags).encode(), digest_size=4).hexdigest()
    return f"{torch.backends.cpu.get_cpu_capability()}-{platform.machine()}-{digest}"


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

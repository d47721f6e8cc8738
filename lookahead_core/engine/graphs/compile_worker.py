"""A graph compiled in a process of its own, at the lowest priority: its tracing holds no GIL the
engine needs, its workspace is returned to the system when it exits, and the weights it traces are
empty tensors of the served model's shapes (a package holds no weights, so it never needs their
values; the buffers it folds, rotary frequencies, are the served model's own)."""
from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lookahead_core.engine.graphs.attention import install_sdpa_gqa, tracing
from lookahead_core.engine.graphs.buckets import Bucket
from lookahead_core.engine.graphs.package_store import PackageName, PackageStore
from lookahead_core.engine.graphs.staging import DynamicStaging
from lookahead_core.engine.graphs.step import StepModule, decode_step, prefill_step
from lookahead_core.engine.runner.weights import apply_layout


@dataclass(frozen=True)
class GraphJob:
    """Everything a worker needs to compile one graph of the served model, picklable."""

    bucket: Bucket
    name: PackageName
    root: str
    model_class: type
    config: Any  # the model's transformers config
    dtype: torch.dtype
    layout: str  # the weight layout (runner/weights.py): the graph reads tensors laid out so
    kv_shape: tuple[int, ...]  # one layer's keys (and values): [max_batch, kv_heads, capacity, head_dim]
    layers: int
    scratch: int
    signature: str  # the layouts of the constants the serving process will supply (`constants_signature`)
    options: dict
    buffers: dict[str, torch.Tensor]  # the served model's buffers (small): a graph folds their values into its code
    cores: frozenset[int] | None = None


def constants_signature(module: torch.nn.Module) -> str:
    """A digest of each constant's name, dtype, shape and strides: a graph reads its constants as
    they were laid out when it was traced."""
    import hashlib

    digest = hashlib.blake2b(digest_size=8)
    for fqn, t in sorted({**dict(module.named_parameters(remove_duplicate=False)),
                          **dict(module.named_buffers(remove_duplicate=False))}.items()):
        layout = "mkldnn" if t.is_mkldnn else tuple(t.stride())
        digest.update(f"{fqn}:{t.dtype}:{tuple(t.shape)}:{layout};".encode())
    return digest.hexdigest()


def shaped_model(model_class: type, config: Any, dtype: torch.dtype, layout: str) -> torch.nn.Module:
    """The served model's modules over uninitialised tensors, laid out as the served model's."""
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=dtype)  # type: ignore[attr-defined]
    model.to_empty(device="cpu")  # untouched pages: not resident
    model.tie_weights()
    apply_layout(model, layout, copy=False)
    return model.eval()


def export_step(step: StepModule, staging: DynamicStaging) -> torch.export.ExportedProgram:
    """The step traced over every size `staging` takes (its batch, width and key count dynamic)."""
    example = staging.example()
    dims = staging.export_dims()
    sizes = {name: torch.export.Dim(name, min=lo, max=hi) for d in dims.values() for name, lo, hi in d.values()}
    spec: dict[str, Any] = {n: {d: sizes[name] for d, (name, _, _) in dims.get(n, {}).items()} or None
                            for n in ("ids", "pos", "mask", "cols", "rows")}
    spec["kv"] = [None] * len(staging.kv)
    install_sdpa_gqa()
    with tracing(), torch.no_grad():
        # a guard the solver cannot prove over the dynamic range (packed grouped-query attention's
        # strides in bf16) becomes a check at run time, not a refused export
        return torch.export.export(step, (*example[:5], staging.kv), dynamic_shapes=spec, strict=False,
                                   prefer_deferred_runtime_asserts_over_guards=True)


def compile_graph(job: GraphJob) -> float:
    """Trace, compile and store one graph; returns the seconds it took."""
    t0 = time.perf_counter()
    model = shaped_model(job.model_class, job.config, job.dtype, job.layout)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(job.buffers[name])
    step = StepModule(model, prefill_step if job.bucket.prefill else decode_step)
    if (signature := constants_signature(step)) != job.signature:
        raise RuntimeError(f"the rebuilt model's constants are laid out otherwise than the served one's "
                           f"({signature} against {job.signature})")
    kv = [torch.empty(job.kv_shape, dtype=job.dtype) for _ in range(2 * job.layers)]
    program = export_step(step, DynamicStaging(job.bucket, kv, job.scratch, job.dtype, torch.device("cpu")))

    def write(archive: str) -> None:
        torch._inductor.aoti_compile_and_package(program, package_path=archive, inductor_configs=dict(job.options))

    PackageStore(job.root).store(job.name, write)
    return time.perf_counter() - t0


def lowest_priority(cores: frozenset[int] | None) -> None:
    """This process at nice 19, on `cores` where given (the engine's thread may be bound to fewer)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 19)
        if cores:
            os.sched_setaffinity(0, cores)
    except (OSError, AttributeError):
        pass


def _die_with_parent() -> None:
    """This process ends when the one that started it does, however that ends (Linux)."""
    import contextlib
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _child(job: GraphJob, conn) -> None:
    _die_with_parent()
    lowest_priority(job.cores)
    try:
        conn.send(("ok", compile_graph(job)))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def compile_in_worker(job: GraphJob, started: Callable[[Any], None] = lambda process: None) -> float:
    """Compile `job` in a fresh process (told to `started`, which may kill it) and wait for it;
    returns its seconds, or raises RuntimeError with the worker's error."""
    if (refused := PackageStore(job.root).refused(job.name)) is not None:  # a build that fails each time
        raise RuntimeError(f"compiling {job.bucket} is refused: {refused}")
    ctx = multiprocessing.get_context("spawn")  # never fork a process that runs threads
    parent, child = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(job, child), name=f"compile-{job.bucket.slug}", daemon=True)
    process.start()
    started(process)
    child.close()
    try:
        status, value = parent.recv()
    except EOFError:
        status, value = "error", "the compile worker died"
    finally:
        process.join()
        parent.close()
    if status != "ok":
        raise RuntimeError(f"compiling {job.bucket} failed: {value} (exit code {process.exitcode})")
    return float(value)

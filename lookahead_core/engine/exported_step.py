"""A bucket's decode step compiled ahead of time (AOTInductor) and kept on disk as a package.

`torch.compile` traces the model, runs AOT autograd and the freezing passes again at every start
before its on-disk cache can answer, most of a load's time; freezing also keeps AOT autograd's
cache out. A package holds the compiled graph with its frozen, packed weights: a later start on
the machine loads it (the library opened, its weights with it) and runs.

The step is exported (`torch.export`, strict: the trace dynamo makes, so the attention chosen in
traces, `install_sdpa_gqa`, applies) with the KV slot tensors as inputs it writes in place, and
the sizes the staging lets vary (key length; width where the bucket is wider than two) as
dimensions of their ranges. A package is found by a key of everything its code depends on: the
weights, the model's config, the bucket and its ranges, the KV tensors' shapes, inductor's
options, the threads it was compiled for, the CPU, the torch and transformers versions, and the
source of the engine's modules traced, as imported; a newer package of the same bucket and
weights replaces older ones.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from torch._inductor.runtime.cache_dir_utils import cache_dir

from lookahead_core.engine.bucket_staging import Bucket, BucketCache

log = logging.getLogger(__name__)

PACKAGE_SUFFIX = ".pt2"


def package_store() -> Path:
    """Where packages are kept: a folder of inductor's cache (TORCHINDUCTOR_CACHE_DIR, else its
    default), beside the rest of inductor's compiled code."""
    return Path(cache_dir()) / "lookahead_packages"


class _StepModule(torch.nn.Module):
    """The step as a module for export: the model a submodule (its weights frozen into the
    package), the KV slot tensors inputs written in place."""

    def __init__(self, model: torch.nn.Module, step: Callable, kv_len: int, gather: bool) -> None:
        super().__init__()
        self.model, self.step, self.kv_len, self.gather = model, step, kv_len, gather

    def forward(self, ids, pos, mask, cols, rows, kv: list[torch.Tensor]):
        cache = BucketCache(list(zip(kv[0::2], kv[1::2])), rows, cols, self.kv_len, gather=self.gather)
        return self.step(self.model, ids, pos, mask, cols, cache)


class ExportedStep:
    """A bucket's graph as a package: called as the step function is (model, ids, positions, mask,
    KV columns, cache), it loads the package on its first call, or exports, compiles and stores
    it where none is stored, then runs it. `cached` says which (None before the first call)."""

    def __init__(self, step: Callable, bucket: Bucket, options: dict, dims: dict[str, dict[int, tuple[str, int, int]]],
                 key: str, store: Path) -> None:
        self.step, self.bucket, self.options, self.dims = step, bucket, options, dims
        self.path = store / f"{_slug(bucket)}-{key}{PACKAGE_SUFFIX}"
        self.cached: bool | None = None
        self._run: Callable[[list], list] | None = None
        self._kv: list[torch.Tensor] = []

    def __call__(self, model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                 cols: torch.Tensor, cache: BucketCache) -> tuple[torch.Tensor, torch.Tensor]:
        if self._run is None:
            self._kv = cache.slot_tensors()
            self._run = self._load_or_build(model, (ids, pos, mask, cols, cache.rows, self._kv), cache)
        # The loader's own call parses its input and output specs on every call; this is the flat form.
        logits, pred = self._run([ids, pos, mask, cols, cache.rows, *self._kv])
        return logits, pred

    def _load_or_build(self, model: torch.nn.Module, args: tuple, cache: BucketCache) -> Callable[[list], list]:
        if self.path.exists():
            try:
                run = _load(self.path)
                self.cached = True
                return run
            except Exception:  # a package another build left, or a torn file: compile it again
                log.exception("loading %s failed; compiling %s again", self.path, self.bucket)
                with contextlib.suppress(OSError):
                    self.path.unlink()
        self._build(model, args, cache)
        self.cached = False
        return _load(self.path)

    def _build(self, model: torch.nn.Module, args: tuple, cache: BucketCache) -> None:
        module = _StepModule(model, self.step, cache.kv, cache.gather)
        sizes = {name: torch.export.Dim(name, min=lo, max=hi)
                 for dims in self.dims.values() for name, lo, hi in dims.values()}
        spec: dict[str, Any] = {n: {d: sizes[name] for d, (name, _, _) in self.dims.get(n, {}).items()} or None
                                for n in ("ids", "pos", "mask", "cols")}
        spec["rows"], spec["kv"] = None, [None] * len(args[5])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.stem}.{os.getpid()}.tmp{PACKAGE_SUFFIX}")
        with torch.inference_mode(False), torch.no_grad():  # inductor freezes only without grad
            program = torch.export.export(module, args, dynamic_shapes=spec, strict=True)
            # a copy: the compile adds its own keys to the dict it is given, which keys other buckets
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=dict(self.options))
        os.replace(tmp, self.path)  # whole or not at all, for a replica starting beside this one
        weights = self.path.stem.split("-")[-2]
        for old in self.path.parent.glob(f"{_slug(self.bucket)}-{weights}-*{PACKAGE_SUFFIX}"):
            if old != self.path and ".tmp" not in old.name:  # an older build's package of these weights
                with contextlib.suppress(OSError):
                    old.unlink()


def _load(path: Path) -> Callable[[list], list]:
    return torch._inductor.aoti_load_package(str(path)).loader.boxed_run


def _slug(bucket: Bucket) -> str:
    return f"{'prefill' if bucket.prefill else 'decode'}-{bucket.batch}x{bucket.width}x{bucket.kv}"


def _source_digest() -> str:
    """The traced code's source as this process imported it: read once, at import, so that a file
    edited under a running process never keys a package its old code compiled."""
    digest = hashlib.blake2b(digest_size=10)
    for name in TRACED_MODULES:
        digest.update((Path(__file__).parent / f"{name}.py").read_bytes())
    return digest.hexdigest()


TRACED_MODULES = ("bucket_staging", "compile_setup", "compiled_forward", "exported_step")
SOURCE_DIGEST = _source_digest()


def package_key(*, weights: str, model: torch.nn.Module, bucket: Bucket, step: Callable, options: dict,
                dims: dict, kv_shape: Sequence, layers: int, threads: int) -> str:
    """The digest a package is found by (the module docstring lists what goes in); the weights'
    tag first, so a newer package of the same bucket and weights replaces the older."""
    digest = hashlib.blake2b(digest_size=10)
    config: Any = model.config
    parts: list[Any] = [
        config.to_json_string(), bucket, step.__name__, sorted(options.items()), sorted(dims.items()), tuple(kv_shape),
        layers, threads, torch.backends.cpu.get_cpu_capability(), torch.__version__, transformers.__version__, SOURCE_DIGEST,
    ]
    for part in parts:
        digest.update(repr(part).encode())
    return f"{weights[:12]}-{digest.hexdigest()}"

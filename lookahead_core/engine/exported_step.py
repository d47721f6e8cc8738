"""A bucket's decode step compiled ahead of time (AOTInductor) and kept on disk as a package.

`torch.compile` traces the model, runs AOT autograd and the freezing passes again at every start
before its on-disk cache can answer, most of a load's time; freezing also keeps AOT autograd's
cache out. A package holds the compiled graph with its frozen, packed weights: a later start on
the machine loads it (the library opened, its weights with it) and runs.

The step is exported (`torch.export`, strict: the trace dynamo makes, so the attention chosen in
traces, `install_sdpa_gqa`, applies) with the KV slot tensors as inputs it writes in place, and
the sizes the staging lets vary (key length; width where the bucket is wider than two) as
dimensions of their ranges. A package is found by its name (package_store.py): the bucket, the
weights, the build (the source of the engine's modules traced, as imported, the CPU, the torch and
transformers versions) and a digest of the rest its code depends on: the model's config, the
bucket's ranges, the KV tensors' shapes, inductor's options and the threads it was compiled for.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from lookahead_core.engine.bucket_staging import Bucket, BucketCache
from lookahead_core.engine.package_store import PackageName, PackageStore


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
                 name: PackageName, store: PackageStore) -> None:
        self.step, self.bucket, self.options, self.dims = step, bucket, options, dims
        self.name, self.store = name, store
        self.cached: bool | None = None
        self._run: Callable[[list], list] | None = None
        self._kv: tuple[torch.Tensor, ...] = ()

    def stored(self) -> bool:
        return self.store.folder(self.name).is_dir()

    def __call__(self, model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                 cols: torch.Tensor, cache: BucketCache) -> tuple[torch.Tensor, torch.Tensor]:
        if self._run is None:
            self._kv = tuple(cache.slot_tensors())
            self._run = self._load_or_build(model, (ids, pos, mask, cols, cache.rows, list(self._kv)), cache)
        logits, pred = self._run([ids, pos, mask, cols, cache.rows, *self._kv])
        return logits, pred

    def _load_or_build(self, model: torch.nn.Module, args: tuple, cache: BucketCache) -> Callable[[list], list]:
        run = self.store.load(self.name)
        self.cached = run is not None
        if run is None:
            self.store.store(self.name, lambda archive: self._compile(model, args, cache, archive))
            run = self.store.load(self.name)
            if run is None:
                raise RuntimeError(f"the package of {self.bucket} was stored but does not load")
        return run

    def _compile(self, model: torch.nn.Module, args: tuple, cache: BucketCache, archive: str) -> None:
        module = _StepModule(model, self.step, cache.kv, cache.gather)
        sizes = {name: torch.export.Dim(name, min=lo, max=hi)
                 for dims in self.dims.values() for name, lo, hi in dims.values()}
        spec: dict[str, Any] = {n: {d: sizes[name] for d, (name, _, _) in self.dims.get(n, {}).items()} or None
                                for n in ("ids", "pos", "mask", "cols")}
        spec["rows"], spec["kv"] = None, [None] * len(args[5])
        with torch.inference_mode(False), torch.no_grad():  # inductor freezes only without grad
            program = torch.export.export(module, args, dynamic_shapes=spec, strict=True)
            # a copy: the compile adds its own keys to the dict it is given, which keys other buckets
            torch._inductor.aoti_compile_and_package(program, package_path=archive, inductor_configs=dict(self.options))


def _slug(bucket: Bucket) -> str:
    return f"{'prefill' if bucket.prefill else 'decode'}-{bucket.batch}x{bucket.width}x{bucket.kv}"


def _source_digest() -> str:
    """The traced code's source as this process imported it: read once, at import, so that a file
    edited under a running process never names a package its old code compiled."""
    digest = hashlib.blake2b(digest_size=10)
    for name in TRACED_MODULES:
        digest.update((Path(__file__).parent / f"{name}.py").read_bytes())
    return digest.hexdigest()


TRACED_MODULES = ("bucket_staging", "compile_setup", "compiled_forward", "exported_step")
SOURCE_DIGEST = _source_digest()


def _digest(parts: Sequence[Any], size: int) -> str:
    digest = hashlib.blake2b(digest_size=size)
    for part in parts:
        digest.update(repr(part).encode())
    return digest.hexdigest()


def package_name(*, weights: str, model: torch.nn.Module, bucket: Bucket, step: Callable, options: dict,
                 dims: dict, kv_shape: Sequence, layers: int, threads: int) -> PackageName:
    """The name a bucket's package is found by (the module docstring lists what goes in)."""
    config: Any = model.config
    build = (SOURCE_DIGEST, torch.backends.cpu.get_cpu_capability(), torch.__version__, transformers.__version__)
    rest = (config.to_json_string(), bucket, step.__name__, sorted(options.items()), sorted(dims.items()),
            tuple(kv_shape), layers, threads)
    return PackageName(_slug(bucket), weights[:12], _digest(build, 4), _digest(rest, 10))

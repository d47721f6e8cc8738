"""Where compiled graphs are kept on disk, and how one is stored, found and loaded.

A graph is an AOTInductor package without its constants: code only, a few MB, loaded against the
process's own weight tensors (`load_constants(..., user_managed=True)`), so every graph reads the
one copy the eager forward reads. AOTInductor writes a package as a zip (`.pt2`); it is kept
unpacked, one folder per package, and loaded in place. A folder appears whole or not at all
(renamed into place), so a replica starting beside the one that compiles it never loads half of one.

The folders are code this service runs, so the root is this user's alone (package_files.py) and
each folder carries a manifest of its files' digests, checked before it loads. A folder that fails
the check, does not load, or whose code a process never returned from (killed by SIGILL, say) is
moved to `quarantine/` and compiled again; one quarantined twice is not compiled again.

A package's name is `<slug>-<build>-<digest>`: `build` digests the code that compiled it (the
traced source, torch, transformers, the instruction set); storing a package drops the packages of
the same slug that another build left, never those of other shapes or options of this build, and
any package or quarantined folder unused for `EVICT_AFTER_S`.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir

from lookahead_core.engine.graphs.package_files import (
    abandoned,
    died_in,
    private_root,
    running,
    seal,
    unsealed,
    work_folder,
)

log = logging.getLogger(__name__)

ABANDONED_AFTER_S = 3600.0  # a work folder whose owner cannot be told alive or dead (another container)
EVICT_AFTER_S = 14 * 86400.0  # a package no process has loaded for this long is dropped
REFUSE_AFTER = 2  # quarantined this many times, a package is not compiled again

Run = Callable[[list], list]


@dataclass(frozen=True)
class PackageName:
    """A package's folder name, `<slug>-<build>-<digest>`."""

    slug: str  # what it runs: decode or prefill, and its largest shape
    build: str  # the code that compiled it
    digest: str  # everything else its code depends on: the model's architecture, dtype, layout, options

    def __str__(self) -> str:
        return f"{self.slug}-{self.build}-{self.digest}"


def default_root() -> Path:
    """A folder of inductor's cache, beside the rest of inductor's compiled code."""
    return Path(cache_dir()) / "lookahead_graphs"


def _allow_amx() -> None:
    """Ask Linux for AMX tile state in this process, as inductor does before it compiles: a package
    built where AMX is present can have AMX kernels, and a process that only loads it (a later start)
    would die with SIGILL on its first tile instruction. A no-op elsewhere and once granted."""
    if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
        log.warning("AMX tile state was refused (arch_prctl); packages with AMX kernels will not run")


def _open(path: Path, constants: Mapping[str, torch.Tensor]) -> Run:
    # The loader takes an unpacked folder as it is; `aoti_load_package` would first try it
    # as an archive, warn, and only then fall back to this same loader.
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    wanted = loader.get_constant_fqns()
    missing = sorted(set(wanted) - set(constants))
    if missing:
        raise KeyError(f"the graph wants constants the model has not: {missing[:3]}")
    loader.load_constants({fqn: constants[fqn] for fqn in wanted}, False, True, True)
    # The Python wrapper's call parses its input and output specs on every call; this is the flat form.
    return loader.boxed_run


def _first_call_recorded(path: Path, run: Run) -> Run:
    """`run`, its first call inside a `running` record: a process that dies in it leaves the
    record, and the next load quarantines the folder rather than crash again."""
    first = True

    def call(inputs: list) -> list:
        nonlocal first
        if not first:
            return run(inputs)
        with running(path):
            out = run(inputs)
        first = False
        return out

    return call


class PackageStore:
    """Package folders under `root` (inductor's cache by default), which must be this user's
    alone: raises `UnsafeRoot` where another user could write there."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = private_root(default_root() if root is None else Path(root))
        self.quarantine_root = self.root / "quarantine"

    def folder(self, name: PackageName) -> Path:
        return self.root / str(name)

    def stored(self, name: PackageName) -> bool:
        return self.folder(name).is_dir()

    def load(self, name: PackageName, constants: Mapping[str, torch.Tensor]) -> Run | None:
        """The package's flat call (inputs as one list) over `constants` (the caller keeps them
        alive), or None where none is stored. A folder that is not as stored, that a process died
        running, or that does not load (left by another torch) is quarantined, so it is compiled again."""
        path = self.folder(name)
        if not path.is_dir():
            return None
        run, why = None, died_in(path) or unsealed(path)
        if why is None:
            _allow_amx()
            try:
                with running(path):  # loading runs the library's initialisers
                    run = _open(path, constants)
            except Exception as exc:
                log.exception("loading %s failed", path)
                why = f"{type(exc).__name__}: {exc}"
        if run is None:
            self.quarantine(name, why or "it did not load")
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # its last use, which eviction reads
        return _first_call_recorded(path, run)

    def quarantine(self, name: PackageName, why: str) -> None:
        """Move the package's folder out of the way (kept to be looked at), so it is compiled again."""
        self.quarantine_root.mkdir(mode=0o700, exist_ok=True)
        kept = self.quarantine_root / f"{name}.{time.time_ns()}"
        try:
            os.replace(self.folder(name), kept)
        except FileNotFoundError:  # another process moved it first
            return
        except OSError:
            shutil.rmtree(self.folder(name), ignore_errors=True)
            return
        with contextlib.suppress(OSError):
            (kept / "QUARANTINED").write_text(why + "\n")
        log.error("package %s is quarantined in %s and compiled again: %s", name, kept, why)

    def refused(self, name: PackageName) -> str | None:
        """Why `name` is not compiled again (quarantined `REFUSE_AFTER` times: its build fails so
        each time), or None."""
        kept = sorted(self.quarantine_root.glob(f"{name}.*"))
        if len(kept) < REFUSE_AFTER:
            return None
        try:
            last = (kept[-1] / "QUARANTINED").read_text().strip()
        except OSError:
            last = "?"
        return (f"{name} was quarantined {len(kept)} times (last: {last}); "
                f"remove its folders from {self.quarantine_root} to compile it again")

    def store(self, name: PackageName, write: Callable[[str], None]) -> None:
        """Run `write(archive_path)` (the compile, writing a `.pt2`), unpack the archive, seal it
        and put its folder in place; then drop what other builds left for the same slug."""
        work = work_folder(self.root, f".{name}.")  # its own: a compile never meets another's files
        try:
            archive = work / "package.pt2"
            write(str(archive))
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(work / "unpacked")
            (top,) = (work / "unpacked").iterdir()  # the archive's one top folder
            seal(top)
            try:
                os.replace(top, self.folder(name))
            except OSError:  # another process stored it first: theirs is whole, keep it
                if not self.folder(name).is_dir():
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        self._sweep(name)

    def _sweep(self, name: PackageName) -> None:
        old = time.time() - EVICT_AFTER_S
        for entry in [*self.root.iterdir(), *self.quarantine_root.glob("*")]:
            with contextlib.suppress(OSError):
                if not entry.is_dir() or entry == self.quarantine_root:
                    continue
                if entry.name.startswith("."):  # a work folder
                    drop = abandoned(entry, ABANDONED_AFTER_S)
                elif entry.name.startswith(f"{name.slug}-") and entry.parent == self.root:
                    drop = not entry.name.startswith(f"{name.slug}-{name.build}-")  # another build's
                else:
                    drop = entry.stat().st_mtime < old
                if drop:
                    shutil.rmtree(entry, ignore_errors=True)


def folder_bytes(path: Path) -> int:
    """Bytes of every file under `path` (a package's code, mapped when it loads)."""
    total = 0
    with contextlib.suppress(OSError):
        for dirpath, _, files in os.walk(path):
            for f in files:
                with contextlib.suppress(OSError):
                    total += os.path.getsize(os.path.join(dirpath, f))
    return total


def digest(parts: Iterable[Any], size: int) -> str:
    """A short digest of the parts' reprs (a package name's fields)."""

    digest = hashlib.blake2b(digest_size=size)
    for part in parts:
        digest.update(repr(part).encode())
    return digest.hexdigest()


def buffers_digest(model: torch.nn.Module) -> str:
    """The model's buffers' values: a graph takes those its code folds as they were when it was traced."""

    digest = hashlib.blake2b(digest_size=8)
    for name, t in model.named_buffers():
        digest.update(name.encode())
        digest.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def architecture(config: Any) -> str:
    """The model config as far as it shapes the code (not where it was loaded from)."""
    fields = config.to_dict()
    for key in ("_name_or_path", "name_or_path", "_commit_hash", "transformers_version"):
        fields.pop(key, None)
    return repr(sorted(fields.items()))

"""Where compiled graphs are kept on disk, and how one is stored, found and loaded.

A graph is an AOTInductor package without its constants: code only, a few MB, loaded against the
process's own weight tensors (`load_constants(..., user_managed=True)`), so every graph reads the
one copy the eager forward reads. AOTInductor writes a package as a zip (`.pt2`); it is kept
unpacked, one folder per package, and loaded in place. A folder appears whole or not at all
(renamed into place), so a replica starting beside the one that compiles it never loads half of one.

A package's name is `<slug>-<build>-<digest>`: `build` digests the code that compiled it (the
traced source, torch, transformers, the instruction set); storing a package drops the packages of
the same slug that another build left, never those of other shapes or options of this build.
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

log = logging.getLogger(__name__)

ABANDONED_AFTER_S = 3600.0

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


class PackageStore:
    """Package folders under `root`."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = default_root() if root is None else Path(root)

    def folder(self, name: PackageName) -> Path:
        return self.root / str(name)

    def stored(self, name: PackageName) -> bool:
        return self.folder(name).is_dir()

    def load(self, name: PackageName, constants: Mapping[str, torch.Tensor]) -> Run | None:
        """The package's flat call (inputs as one list) over `constants` (the caller keeps them
        alive), or None where none is stored. A folder that does not load (torn by hand, or left by
        another torch) is removed, so it is compiled again."""
        path = self.folder(name)
        if not path.is_dir():
            return None
        _allow_amx()
        try:
            # The loader takes an unpacked folder as it is; `aoti_load_package` would first try it
            # as an archive, warn, and only then fall back to this same loader.
            loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
            wanted = loader.get_constant_fqns()
            missing = sorted(set(wanted) - set(constants))
            if missing:
                raise KeyError(f"the graph wants constants the model has not: {missing[:3]}")
            loader.load_constants({fqn: constants[fqn] for fqn in wanted}, False, True, True)
        except Exception:
            log.exception("loading %s failed; it is compiled again", path)
            shutil.rmtree(path, ignore_errors=True)
            return None
        # The Python wrapper's call parses its input and output specs on every call; this is the flat form.
        return loader.boxed_run

    def store(self, name: PackageName, write: Callable[[str], None]) -> None:
        """Run `write(archive_path)` (the compile, writing a `.pt2`), unpack the archive and put its
        folder in place; then drop what other builds left for the same slug."""
        self.root.mkdir(parents=True, exist_ok=True)
        work = self.root / f".{name}.{os.getpid()}.tmp"  # named so that `_drop_other_builds` knows its owner
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            archive = work / "package.pt2"
            write(str(archive))
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(work / "unpacked")
            (top,) = (work / "unpacked").iterdir()  # the archive's one top folder
            try:
                os.replace(top, self.folder(name))
            except OSError:  # another process stored it first: theirs is whole, keep it
                if not self.folder(name).is_dir():
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        self._drop_other_builds(name)

    def _drop_other_builds(self, name: PackageName) -> None:
        for old in self.root.glob(f"{name.slug}-*"):
            if old.is_dir() and not old.name.startswith(f"{name.slug}-{name.build}-"):
                shutil.rmtree(old, ignore_errors=True)
        for work in self.root.glob(".*.tmp"):  # what a compile killed midway left
            pid = work.name.rsplit(".", 2)[-2]
            # its process gone, and for long: a process of another PID namespace sharing the folder
            # may have the same number as a dead one here
            if pid.isdigit() and not _alive(int(pid)) and time.time() - work.stat().st_mtime > ABANDONED_AFTER_S:
                shutil.rmtree(work, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


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

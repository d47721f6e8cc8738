"""PackageStore on archives written by hand (no compile): a package is unpacked into its own
folder, whole or not at all; storing drops what other builds left for the same graph, and what
killed compiles left, never another package of this build."""
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from lookahead_core.engine.graphs.package_store import PackageName, PackageStore

NAME = PackageName("decode-1x1x64", "b1b1b1b1", "d1")


def _archive(top: str, payload: bytes = b"library"):
    def write(path: str) -> None:
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"{top}/data/aotinductor/model/x.wrapper.so", payload)
    return write


def test_a_stored_package_is_its_archive_unpacked_in_a_folder_of_its_name(tmp_path):
    store = PackageStore(tmp_path)
    store.store(NAME, _archive("whatever.tmp"))
    folder = tmp_path / "decode-1x1x64-b1b1b1b1-d1"
    assert store.folder(NAME) == folder
    assert (folder / "data/aotinductor/model/x.wrapper.so").read_bytes() == b"library"
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # the archive and the work folder are gone


def test_a_compile_that_raises_leaves_nothing(tmp_path):
    def fails(path: str) -> None:
        Path(path).write_bytes(b"half")
        raise RuntimeError("compile failed")

    with pytest.raises(RuntimeError, match="compile failed"):
        PackageStore(tmp_path).store(NAME, fails)
    assert list(tmp_path.iterdir()) == []


def test_storing_drops_other_builds_of_the_graph_only(tmp_path):
    store = PackageStore(tmp_path)
    keep = [PackageName("decode-1x1x64", "b1b1b1b1", "d2"),  # this build, another model or options
            PackageName("decode-1x2x64", "b0b0b0b0", "d1")]  # another graph
    drop = [PackageName("decode-1x1x64", "b0b0b0b0", "d1")]  # an older build
    for name in drop + keep:
        store.store(name, _archive("t"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = tmp_path / f".{NAME}.{int(dead.stdout)}.tmp"  # a compile killed midway
    abandoned.mkdir()
    os.utime(abandoned, (time.time() - 7200, time.time() - 7200))
    fresh = tmp_path / f".{NAME}.{int(dead.stdout)}x.tmp"  # not a pid: never touched
    fresh.mkdir()
    store.store(NAME, _archive("t"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([fresh.name, *(str(n) for n in [*keep, NAME])])


def test_a_package_another_process_stored_first_is_kept(tmp_path):
    store = PackageStore(tmp_path)
    store.store(NAME, _archive("t", b"theirs"))
    store.store(NAME, _archive("t", b"ours"))
    assert (store.folder(NAME) / "data/aotinductor/model/x.wrapper.so").read_bytes() == b"theirs"


def test_a_folder_that_does_not_load_is_removed(tmp_path):
    store = PackageStore(tmp_path)
    assert store.load(NAME, {}) is None  # none stored
    store.store(NAME, _archive("t", b"not a library"))
    assert store.load(NAME, {}) is None
    assert not store.folder(NAME).exists()

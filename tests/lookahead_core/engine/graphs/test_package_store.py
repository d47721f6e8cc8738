"""PackageStore on archives written by hand (no compile): a package is unpacked into its own
folder, whole or not at all, this user's alone, with a manifest checked before it loads; a folder
that fails the check, or whose code a process never returned from, is quarantined and not loaded;
storing drops what other builds, killed compiles and long-unused packages left, never another
package of this build or a live compile's work."""
import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from lookahead_core.engine.graphs import package_store
from lookahead_core.engine.graphs.buckets import Bucket
from lookahead_core.engine.graphs.compile_worker import GraphJob, compile_in_worker
from lookahead_core.engine.graphs.package_files import OWNER, UnsafeRoot, this_process
from lookahead_core.engine.graphs.package_store import EVICT_AFTER_S, PackageName, PackageStore

NAME = PackageName("decode-1x1x64", "b1b1b1b1", "d1")
SO = "data/aotinductor/model/x.wrapper.so"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user takes root")


def _archive(top: str, payload: bytes = b"library"):
    def write(path: str) -> None:
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"{top}/{SO}", payload)
            zf.writestr(f"{top}/archive_format", b"pt2")
    return write


@pytest.fixture
def opened(monkeypatch):
    """The loader replaced: the folders it was asked to open; each run returns the `running`
    records in its folder while it runs."""
    calls: list[Path] = []

    def fake_open(path, constants):
        calls.append(path)
        return lambda inputs: [p.name for p in path.glob(".running-*")]

    monkeypatch.setattr(package_store, "_open", fake_open)
    return calls


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)


def _quarantined(store: PackageStore) -> list[str]:
    return sorted((p / "QUARANTINED").read_text() for p in store.quarantine_root.iterdir())


def test_a_stored_package_is_its_archive_unpacked_in_a_folder_of_its_name(tmp_path):
    store = PackageStore(tmp_path)
    store.store(NAME, _archive("whatever.tmp"))
    folder = tmp_path / "decode-1x1x64-b1b1b1b1-d1"
    assert store.folder(NAME) == folder
    assert (folder / SO).read_bytes() == b"library"
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # the archive and the work folder are gone


def test_the_root_and_every_package_are_this_users_alone_with_a_manifest_of_digests(tmp_path):
    root = tmp_path / "graphs"
    store = PackageStore(root)
    store.store(NAME, _archive("t"))
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    entries = [store.folder(NAME), *store.folder(NAME).rglob("*")]
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in entries if p.is_dir()} == {"0o700"}
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in entries if p.is_file()} == {"0o600"}
    manifest = json.loads((store.folder(NAME) / "MANIFEST.json").read_text())
    assert manifest == {SO: hashlib.sha256(b"library").hexdigest(), "archive_format": hashlib.sha256(b"pt2").hexdigest()}


def test_a_root_of_ours_that_others_could_write_is_closed(tmp_path):
    root = tmp_path / "graphs"
    root.mkdir()
    root.chmod(0o777)
    PackageStore(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def _world_writable(folder: Path) -> None:
    folder.chmod(0o777)


def _given_away(folder: Path) -> None:
    os.chown(folder, 12345, 12345)


@pytest.mark.parametrize("change,where", [pytest.param(_given_away, "root", marks=as_root),
                                          pytest.param(_given_away, "ancestor", marks=as_root),
                                          (_world_writable, "ancestor")])
def test_a_root_another_user_could_change_is_refused(tmp_path, change, where):
    """Whoever can write the root, or swap a folder above it, chooses the code this service runs:
    such a root is refused at construction, naming the folder. (A root of ours open to others is
    closed instead, above.)"""
    ancestor = tmp_path / "shared"
    root = ancestor / "graphs"
    root.mkdir(parents=True)
    folder = root if where == "root" else ancestor
    change(folder)
    with pytest.raises(UnsafeRoot, match=re.escape(f"{folder} ")):
        PackageStore(root)


def test_a_shared_ancestor_with_the_sticky_bit_is_allowed(tmp_path):
    """/tmp's case: others may write there but not rename or remove what is ours."""
    ancestor = tmp_path / "tmp"
    ancestor.mkdir()
    ancestor.chmod(0o1777)
    assert PackageStore(ancestor / "graphs").root == (ancestor / "graphs").resolve()


def test_a_sealed_package_loads_and_its_first_call_runs_inside_a_record(tmp_path, opened):
    """The record a process that dies in the call leaves behind (below); gone once it returns."""
    store = PackageStore(tmp_path)
    store.store(NAME, _archive("t"))
    run = store.load(NAME, {})
    assert run is not None and opened == [store.folder(NAME)]
    assert len(run([])) == 1 and run([]) == []  # the first call only
    assert not list(store.folder(NAME).glob(".running-*"))


def _changed_so(folder: Path) -> None:
    (folder / SO).write_bytes(b"someone else's library")


def _added_so(folder: Path) -> None:
    (folder / "data/aotinductor/model/y.wrapper.so").write_bytes(b"library")
    (folder / "data/aotinductor/model/y.wrapper.so").chmod(0o600)


def _no_manifest(folder: Path) -> None:
    (folder / "MANIFEST.json").unlink()


def _removed_file(folder: Path) -> None:
    (folder / "archive_format").unlink()


def _writable_by_group(folder: Path) -> None:
    (folder / SO).chmod(0o620)


def _linked(folder: Path) -> None:
    (folder / SO).unlink()
    (folder / SO).symlink_to("/bin/true")


@pytest.mark.parametrize("tamper", [_changed_so, _added_so, _no_manifest, _removed_file, _writable_by_group, _linked])
def test_a_package_not_as_stored_is_quarantined_and_never_opened(tmp_path, opened, tamper):
    store = PackageStore(tmp_path)
    store.store(NAME, _archive("t"))
    tamper(store.folder(NAME))
    assert store.load(NAME, {}) is None
    assert opened == [] and not store.folder(NAME).exists()
    (reason,) = _quarantined(store)
    assert reason.strip()


_DIES_IN_FIRST_CALL = """
import os, signal, sys
from lookahead_core.engine.graphs import package_store as ps
ps._open = lambda path, constants: (lambda inputs: os.kill(os.getpid(), signal.SIGILL))
run = ps.PackageStore(sys.argv[1]).load(ps.PackageName("decode-1x1x64", "b1b1b1b1", "d1"), {})
run([])
"""


def test_a_package_whose_first_call_killed_its_process_is_quarantined_not_loaded(tmp_path, opened):
    """A package built for instructions this CPU lacks dies by SIGILL on its first call, where no
    exception is caught: the record of that call stays, and the next start quarantines the folder
    and compiles it again rather than crash again."""
    store = PackageStore(tmp_path)
    store.store(NAME, _archive("t"))
    child = subprocess.run([sys.executable, "-c", _DIES_IN_FIRST_CALL, str(tmp_path)], capture_output=True, text=True)
    assert child.returncode == -4, child.stderr[-2000:]  # SIGILL
    assert store.load(NAME, {}) is None and opened == [] and not store.folder(NAME).exists()
    assert "never returned from its code" in _quarantined(store)[0]


@pytest.mark.parametrize("record,loads", [
    ({}, True),  # this process, in its own first call
    ({"boot": "another boot"}, False),  # this host restarted since
    ({"host": "elsewhere"}, False),  # cannot be told alive: not trusted
])
def test_a_record_of_a_first_call_loads_only_where_its_process_is_known_to_run(tmp_path, opened, record, loads):
    store = PackageStore(tmp_path)
    store.store(NAME, _archive("t"))
    (store.folder(NAME) / ".running-x").write_text(json.dumps({**this_process(), **record}))
    assert (store.load(NAME, {}) is not None) == loads
    assert store.folder(NAME).exists() == loads


def test_a_package_quarantined_twice_is_not_compiled_again(tmp_path):
    store = PackageStore(tmp_path)
    job = GraphJob(Bucket(1, 1, 64), NAME, str(store.root), object, None, None, "plain", (1,), 1, 63, "", {}, {})
    for _ in range(2):
        assert store.refused(NAME) is None
        store.store(NAME, _archive("t"))
        _no_manifest(store.folder(NAME))
        assert store.load(NAME, {}) is None
    assert "quarantined 2 times" in store.refused(NAME)
    with pytest.raises(RuntimeError, match="refused: .*quarantined 2 times"):
        compile_in_worker(job, started=lambda process: pytest.fail("a worker started"))


def test_a_compile_that_raises_leaves_nothing(tmp_path):
    def fails(path: str) -> None:
        Path(path).write_bytes(b"half")
        raise RuntimeError("compile failed")

    with pytest.raises(RuntimeError, match="compile failed"):
        PackageStore(tmp_path).store(NAME, fails)
    assert list(tmp_path.iterdir()) == []


def test_two_compiles_of_one_package_at_once_keep_their_own_work_folders(tmp_path):
    """Processes in two containers can have one PID: a compile of the same package that starts
    while this one runs never touches this one's work folder, and the first stored is kept."""
    store = PackageStore(tmp_path)

    def outer(path: str) -> None:
        store.store(NAME, _archive("t", b"inner"))
        _archive("t", b"outer")(path)

    store.store(NAME, outer)
    assert (store.folder(NAME) / SO).read_bytes() == b"inner"
    assert [p.name for p in tmp_path.iterdir()] == [str(NAME)]


def test_storing_drops_other_builds_of_the_graph_only(tmp_path):
    store = PackageStore(tmp_path)
    keep = [PackageName("decode-1x1x64", "b1b1b1b1", "d2"),  # this build, another model or options
            PackageName("decode-1x2x64", "b0b0b0b0", "d1")]  # another graph
    drop = [PackageName("decode-1x1x64", "b0b0b0b0", "d1")]  # an older build
    for name in drop + keep:
        store.store(name, _archive("t"))
    store.store(NAME, _archive("t"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(str(n) for n in [*keep, NAME])


def _work(root: Path, name: str, record: dict | None, age_s: float = 0.0) -> Path:
    work = root / name
    work.mkdir()
    if record is not None:
        (work / OWNER).write_text(json.dumps({**this_process(), **record}))
    os.utime(work, (time.time() - age_s, time.time() - age_s))
    return work


def test_storing_drops_work_folders_whose_compile_surely_ended(tmp_path):
    store = PackageStore(tmp_path)
    gone = [_work(tmp_path, ".a.dead", {"pid": _dead_pid()}),  # its process ended, here
            _work(tmp_path, ".a.rebooted", {"boot": "another boot"}),
            _work(tmp_path, ".a.old", {"host": "elsewhere"}, age_s=2 * package_store.ABANDONED_AFTER_S),
            _work(tmp_path, f".{NAME}.123.tmp", None, age_s=2 * package_store.ABANDONED_AFTER_S)]
    kept = [_work(tmp_path, ".a.live", {}),  # this process
            _work(tmp_path, ".a.elsewhere", {"host": "elsewhere"}),  # another container's, and recent
            _work(tmp_path, ".a.starting", None)]  # its record not written yet
    store.store(NAME, _archive("t"))
    assert not any(p.exists() for p in gone) and all(p.exists() for p in kept)


def test_packages_unused_for_long_are_evicted_and_loading_counts_as_use(tmp_path, opened):
    store = PackageStore(tmp_path)
    used, unused = PackageName("decode-1x2x64", "b1b1b1b1", "d1"), PackageName("decode-1x4x64", "b1b1b1b1", "d1")
    long_ago = time.time() - 2 * EVICT_AFTER_S
    for name in (used, unused):
        store.store(name, _archive("t"))
    for name in (used, unused):
        os.utime(store.folder(name), (long_ago, long_ago))
    assert store.load(used, {}) is not None
    store.store(NAME, _archive("t"))
    assert store.stored(used) and not store.stored(unused)


def test_a_package_another_process_stored_first_is_kept(tmp_path):
    store = PackageStore(tmp_path)
    store.store(NAME, _archive("t", b"theirs"))
    store.store(NAME, _archive("t", b"ours"))
    assert (store.folder(NAME) / SO).read_bytes() == b"theirs"


def test_a_folder_that_does_not_load_is_quarantined(tmp_path):
    store = PackageStore(tmp_path)
    assert store.load(NAME, {}) is None  # none stored
    store.store(NAME, _archive("t", b"not a library"))
    assert store.load(NAME, {}) is None
    assert not store.folder(NAME).exists() and len(_quarantined(store)) == 1

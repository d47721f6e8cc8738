"""The package store's files: a root only this user (and root) can change, a manifest of each
package's file digests, and records of the process working in a folder (a compile, a package's
code running), so a process that died there is told from one that still runs."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

MANIFEST = "MANIFEST.json"
RUNNING = ".running-"  # a record `running` leaves in a package folder while its code runs
OWNER = ".owner"  # a work folder's record of the process compiling in it


class UnsafeRoot(PermissionError):
    """A package root another user could write to: whatever is found there is code this service would run."""


def private_root(path: Path) -> Path:
    """`path` created (or tightened) to 0700 and resolved. Raises UnsafeRoot where it belongs to
    another user, or an ancestor belongs to another user than root or is writable by others without
    the sticky bit: either could swap the root for a folder of their own."""
    path = Path(path).absolute()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    real = path.resolve(strict=True)  # checked and used as resolved: a link swapped later is never followed
    me = os.geteuid()
    for folder in reversed(real.parents):
        st = folder.stat()
        if st.st_uid not in (0, me):
            raise UnsafeRoot(f"package root {real}: its folder {folder} belongs to uid {st.st_uid}, "
                             f"who could replace the compiled code this service runs; choose a compile_dir "
                             f"under folders of root or uid {me} only")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafeRoot(f"package root {real}: its folder {folder} is writable by others "
                             f"(mode {stat.S_IMODE(st.st_mode):o}, no sticky bit), who could replace the "
                             f"compiled code this service runs")
    st = real.stat()
    if st.st_uid != me:
        raise UnsafeRoot(f"package root {real} belongs to uid {st.st_uid}, not this user ({me}): its "
                         f"packages could be anyone's code")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(real, 0o700)
    return real


def _entries(folder: Path) -> Iterator[tuple[str, Path]]:
    for dirpath, dirs, files in os.walk(folder):
        for name in (*dirs, *files):
            p = Path(dirpath, name)
            yield p.relative_to(folder).as_posix(), p


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _recorded(rel: str) -> bool:
    return rel == MANIFEST or rel.startswith(RUNNING)


def seal(folder: Path) -> None:
    """Write the folder's manifest (each file's sha256) and make it this user's alone: folders
    0700, files 0600, whatever the archive and the umask said."""
    digests = {rel: _sha256(p) for rel, p in _entries(folder) if p.is_file() and not _recorded(rel)}
    (folder / MANIFEST).write_text(json.dumps(digests, indent=0, sort_keys=True))
    os.chmod(folder, 0o700)
    for _, p in _entries(folder):
        os.chmod(p, 0o700 if p.is_dir() else 0o600)


def unsealed(folder: Path) -> str | None:
    """Why the folder is not as `seal` left it (no manifest, a file missing, added or changed, a
    link, an entry another user can write), or None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no readable {MANIFEST}"
    if not isinstance(manifest, dict):
        return f"{MANIFEST} is not a table of digests"
    me, seen = os.geteuid(), set()
    for rel, p in [(".", folder), *_entries(folder)]:
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode) or not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            return f"{rel} is not a plain file or folder"
        if st.st_uid != me or st.st_mode & 0o022:
            return f"{rel} can be written by another user (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
        if stat.S_ISREG(st.st_mode) and not _recorded(rel):
            if manifest.get(rel) != _sha256(p):
                return f"{rel} is not in {MANIFEST}" if rel not in manifest else f"{rel} does not match {MANIFEST}"
            seen.add(rel)
    if missing := sorted(set(manifest) - seen):
        return f"{missing[0]} is missing"
    return None


# ---- who works in a folder --------------------------------------------------------------------------

def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """The process's start (clock ticks after boot, /proc/<pid>/stat): a PID reused later differs."""
    stat_line = _read(f"/proc/{pid}/stat")
    return stat_line.rpartition(")")[2].split()[19] if stat_line else None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def this_process() -> dict:
    """Where and which process this is: host, boot, PID namespace, PID and start time."""
    return {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"),
            "pidns": _pid_namespace(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def write_record(path: Path) -> None:
    path.write_text(json.dumps(this_process()))


def read_record(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def alive(record: dict | None) -> bool | None:
    """Whether the process a record names still runs: told on this host, in this boot (another
    boot: False) and PID namespace; None where it cannot be told (another host or container)."""
    me = this_process()
    if record is None or record.get("host") != me["host"]:
        return None
    if record.get("boot") != me["boot"]:
        return False  # this host restarted since
    pid = record.get("pid")
    if record.get("pidns") != me["pidns"] or not isinstance(pid, int):
        return None
    if me["start"] is None:  # no /proc: the PID alone
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 0)
            return True
        return False
    return _start_time(pid) == record.get("start")


@contextlib.contextmanager
def running(folder: Path) -> Iterator[None]:
    """A record in `folder` while the body runs; a process killed in it (a package's code hitting
    an instruction this CPU lacks: SIGILL) leaves it behind for `died_in`."""
    path = None
    with contextlib.suppress(OSError):
        fd, path = tempfile.mkstemp(dir=folder, prefix=RUNNING)
        with os.fdopen(fd, "w") as f:
            json.dump(this_process(), f)
    try:
        yield
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)


def died_in(folder: Path) -> str | None:
    """Why a process may have died running this folder's code (a `running` record of a process
    not known to run), or None."""
    for p in folder.glob(RUNNING + "*"):
        record = read_record(p)
        if alive(record) is not True:
            who = f"pid {record.get('pid')} on {record.get('host')}" if record else "a process"
            return f"{who} never returned from its code"
    return None


def work_folder(root: Path, prefix: str) -> Path:
    """A new private folder in `root` for one compile, recording who works in it."""
    work = Path(tempfile.mkdtemp(dir=root, prefix=prefix))
    write_record(work / OWNER)
    return work


def abandoned(work: Path, max_age_s: float) -> bool:
    """A work folder whose compile has surely ended: its process gone, or where that cannot be
    told (another container, no record yet), the folder untouched for `max_age_s`."""
    state = alive(read_record(work / OWNER))
    if state is not None:
        return not state
    try:
        return time.time() - work.stat().st_mtime > max_age_s
    except OSError:
        return False

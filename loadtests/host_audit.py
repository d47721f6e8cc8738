"""Audit a running server from outside, as another user of its host would see it: what under its
runtime folders (HAProxy's, Ray's session) others could write to or connect to, and what listens
on every interface.

    python -m loadtests.host_audit --ray-session DIR --haproxy-dir DIR [--ports 8404,9101]

Prints one finding a line and exits 1 when there is any. As a library: `folder_findings`,
`open_listeners`, `audit`, each a list of findings (empty: clean).

A path counts only where others can reach it: a mode that lets group or others write (for a
socket: connect) says nothing inside a folder they cannot pass (Ray makes its session folders 0777
whatever the umask; under a 0700 folder no one else can use them).
"""
from __future__ import annotations

import argparse
import os
import stat
import sys
from collections.abc import Collection, Iterable
from pathlib import Path

from deployments.ray_env import holders, listeners

PASS = stat.S_IXGRP | stat.S_IXOTH  # a folder others may pass through (group's or others' execute)
WRITE = stat.S_IWGRP | stat.S_IWOTH
EVERY_INTERFACE = ("0.0.0.0", "::")


def folder_findings(folder: Path) -> list[str]:
    """Paths under `folder` (itself included) that group or others may write to, or connect to
    (a socket), where every folder above lets them through; and paths of another owner than
    `folder`'s (a file another user placed there first)."""
    folder = Path(os.path.abspath(folder))
    top = folder.lstat()
    reachable = all(p.stat().st_mode & PASS for p in folder.parents)
    found = _check(folder, top, top.st_uid, reachable)
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        through = reachable and _passable(here, folder)
        for name in dirs + files:
            path = here / name
            try:
                found += _check(path, path.lstat(), top.st_uid, through)
            except FileNotFoundError:  # gone meanwhile (a log rotated, a socket replaced)
                continue
    return found


def _passable(folder: Path, top: Path) -> bool:
    """Every folder from `top` down to `folder`, both included, lets group or others through."""
    path = folder
    while True:
        try:
            if not path.lstat().st_mode & PASS:
                return False
        except FileNotFoundError:
            return False
        if path == top:
            return True
        path = path.parent


def _check(path: Path, st: os.stat_result, owner: int, reachable: bool) -> list[str]:
    if stat.S_ISLNK(st.st_mode):
        return [] if st.st_uid == owner else [f"{path}: a link of uid {st.st_uid}, not of the folder's owner (uid {owner})"]
    found = []
    if st.st_uid != owner:
        found.append(f"{path}: owned by uid {st.st_uid}, not by the folder's owner (uid {owner})")
    if reachable and st.st_mode & WRITE:
        who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit)
        what = "connect to this socket" if stat.S_ISSOCK(st.st_mode) else "write here"
        found.append(f"{path}: {stat.filemode(st.st_mode)}, {who} may {what}")
    return found


def open_listeners(ports: Collection[int] | None = None) -> list[str]:
    """TCP sockets of this host listening on every interface (0.0.0.0, ::), each with what holds
    it; only those on `ports` where given."""
    found = []
    for s in sorted({(s.address, s.port) for s in listeners() if s.address in EVERY_INTERFACE}, key=lambda s: s[1]):
        if ports is None or s[1] in ports:
            who = "; ".join(holders(s[1])) or "a process this user cannot see"
            found.append(f"port {s[1]} listens on every interface ({s[0]}): {who}")
    return found


def audit(folders: Iterable[Path], ports: Collection[int] | None = None) -> list[str]:
    """`folder_findings` of each folder, then `open_listeners`."""
    return [f for folder in folders for f in folder_findings(folder)] + open_listeners(ports)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.host_audit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ray-session", type=Path, action="append", default=[], help="a Ray session folder")
    ap.add_argument("--haproxy-dir", type=Path, action="append", default=[], help="HAProxy's folder")
    ap.add_argument("--ports", default=None, help="comma-separated: check only these for every-interface listeners")
    args = ap.parse_args(argv)
    ports = None if args.ports is None else {int(p) for p in args.ports.split(",") if p}
    missing = [str(f) for f in args.ray_session + args.haproxy_dir if not f.is_dir()]
    if missing:
        ap.error(f"not a folder: {', '.join(missing)}")
    findings = audit(args.ray_session + args.haproxy_dir, ports)
    print("\n".join(findings) if findings else "nothing found")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())

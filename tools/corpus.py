"""The default model's corpus: Python source of the standard library and of permissively licensed packages."""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# (distribution, licence it must declare). Checked against the installed metadata at build time.
PACKAGES = [
    ("numpy", "BSD"), ("pydantic", "MIT"), ("fastapi", "MIT"), ("starlette", "BSD"), ("locust", "MIT"),
    ("requests", "Apache"), ("urllib3", "MIT"), ("PyYAML", "MIT"), ("Jinja2", "BSD"), ("click", "BSD"),
    ("aiohttp", "Apache"), ("packaging", "Apache"), ("setuptools", "MIT"), ("pip", "MIT"), ("flask", "BSD"),
    ("werkzeug", "BSD"), ("pytest", "MIT"), ("anyio", "MIT"), ("rich", "MIT"), ("attrs", "MIT"),
    ("jsonschema", "MIT"), ("networkx", "BSD"), ("huggingface_hub", "Apache"), ("transformers", "Apache"),
    ("ray", "Apache"), ("torch", "Apache"),
]
STDLIB_LICENCE = "PSF-2.0"
SKIP_PARTS = {"test", "tests", "testing", "_vendor", "vendor", "site-packages", "idlelib", "lib2to3"}


@dataclass(frozen=True)
class SourceFile:
    origin: str  # "stdlib" or a distribution name
    path: str  # relative to its origin's root
    text: str

    @property
    def key(self) -> str:
        return f"{self.origin}/{self.path}"

    def held_out(self, share: float) -> bool:
        digest = hashlib.sha1(self.key.encode()).digest()
        return int.from_bytes(digest[:4], "big") / 2**32 < share


def _licence(dist) -> str:
    meta = dist.metadata
    text = meta.get("License-Expression") or meta.get("License") or ""
    classifiers = " ".join(c for c in (meta.get_all("Classifier") or []) if c.startswith("License"))
    return f"{text} {classifiers}".strip()


def _read(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text if 200 <= len(text) <= 400_000 else None


def collect(max_mb_per_origin: float = 8.0) -> tuple[list[SourceFile], list[dict]]:
    """Files in a fixed order, each origin capped at `max_mb_per_origin` (files picked by hash)."""
    origins: list[tuple[str, str, str, list[Path], Path]] = []
    std = Path(sysconfig.get_paths()["stdlib"])
    origins.append(("stdlib", "", STDLIB_LICENCE, sorted(std.rglob("*.py")), std))
    for name, want in PACKAGES:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        licence = _licence(dist)
        if want.lower() not in licence.lower():
            continue
        root = Path(dist.locate_file(""))
        paths = sorted(Path(dist.locate_file(f)) for f in (dist.files or []) if str(f).endswith(".py"))
        origins.append((name, dist.version, licence, paths, root))

    files, manifest = [], []
    cap = int(max_mb_per_origin * 1e6)
    for name, version, licence, paths, root in origins:
        chosen = []
        for p in paths:
            rel = p.relative_to(root)
            if SKIP_PARTS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
                continue
            text = _read(p)
            if text is not None:
                chosen.append(SourceFile(name, rel.as_posix(), text))
        # Salted, so the cap does not favour the files that the held-out test picks.
        chosen.sort(key=lambda f: hashlib.sha1(b"cap:" + f.key.encode()).hexdigest())
        kept, size = [], 0
        for f in chosen:
            if size + len(f.text) > cap:
                continue
            kept.append(f)
            size += len(f.text)
        kept.sort(key=lambda f: f.key)
        files.extend(kept)
        manifest.append({"origin": name, "version": version or "python", "licence": licence, "files": len(kept), "chars": size})
    return files, manifest

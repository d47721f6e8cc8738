"""The code's shape: folders of at most 16 modules, modules of at most 300 lines, imports without
cycles, and the algorithm (`lookahead_core/lookahead/`) free of the model, the engine and serving."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lookahead_core", "deployments")
MAX_MODULES, MAX_LINES = 16, 300


def _modules():
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules of this project that `path` imports at module level (a function's own imports run late)."""
    tree = ast.parse(path.read_text())
    package = _name(path) if path.name == "__init__.py" else _name(path).rpartition(".")[0]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    known = {_name(p) for p in _modules()}
    return {m for m in found if m in known}


def test_no_folder_holds_more_than_16_modules_and_no_module_more_than_300_lines():
    folders: dict[Path, int] = {}
    for path in _modules():
        folders[path.parent] = folders.get(path.parent, 0) + 1
    crowded = {str(f.relative_to(ROOT)): n for f, n in folders.items() if n > MAX_MODULES}
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not crowded and not long, (crowded, long)


def test_imports_have_no_cycles():
    graph = {_name(p): _imports(p) - {_name(p)} for p in _modules()}
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path[path.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_algorithm_imports_no_model_engine_or_serving_code():
    for path in (ROOT / "lookahead_core" / "lookahead").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        bad = {m for m in names if m.startswith(("transformers", "lookahead_core.engine", "lookahead_core.models",
                                                  "lookahead_core.serving", "deployments", "ray"))}
        assert not bad, f"{path.name} imports {sorted(bad)}"

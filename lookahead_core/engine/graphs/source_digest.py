"""A digest of code as it runs, not as it is written: its syntax tree without docstrings (comments
are not in the tree), so an edit of either keeps every compiled package."""
from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def code_digest(source: str) -> str:
    """The digest of one piece of source text."""
    tree = _strip_docstrings(ast.parse(textwrap.dedent(source)))
    return hashlib.blake2b(ast.dump(tree, include_attributes=False).encode(), digest_size=10).hexdigest()


def source_digest(*objects: object) -> str:
    """The digest of these functions, classes or modules together, read once (at import: a file
    edited under a running process never names a package its old code compiled)."""
    digest = hashlib.blake2b(digest_size=10)
    for obj in objects:
        digest.update(code_digest(inspect.getsource(obj)).encode())  # type: ignore[arg-type]
    return digest.hexdigest()

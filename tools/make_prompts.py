"""Build the benchmark prompt sets from material on this machine.

    python -m tools.make_prompts --model models/tiny-pycoder

code.jsonl: functions of the model's held-out files, prompt = signature + docstring, reference
= the body. text.jsonl: the opening of prose paragraphs from README files under /usr/share/doc and
package descriptions (METADATA) of the installed distributions.
"""
from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import importlib.metadata as md
import json
import re
from pathlib import Path

from tools.corpus import collect


def _h(s: str) -> str:
    return hashlib.sha1(s.encode()).hexdigest()


def code_prompts(model_dir: Path, count: int, per_file: int, max_prompt_chars: int) -> list[dict]:
    manifest = json.loads((model_dir / "corpus.json").read_text())
    held = set(manifest["heldout_files"])
    files, _ = collect()
    files = [f for f in files if f.key in held]
    rows = []
    for f in sorted(files, key=lambda f: _h(f.key)):
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        lines = f.text.splitlines(keepends=True)
        taken = 0
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(nodes, key=lambda n: n.lineno):
            doc = ast.get_docstring(node, clean=False)
            if not doc or len(node.body) < 2:
                continue
            head = "".join(lines[node.lineno - 1 : node.body[0].end_lineno])
            body = "".join(lines[node.body[0].end_lineno : node.end_lineno])
            # Strip the def line's indentation from every line, so methods stand alone.
            indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
            head_d = "".join(line[indent:] if line.strip() else line for line in head.splitlines(keepends=True))
            body_d = "".join(line[indent:] if line.strip() else line for line in body.splitlines(keepends=True))
            # End at the closing quotes: the newline and indentation that open the body are one
            # token in training text, so a prompt ending in a bare newline would mislead the model.
            head_d, body_d = head_d.rstrip("\n"), head_d[len(head_d.rstrip("\n")) :] + body_d
            if len(head_d) > max_prompt_chars or len(body_d) < 40:
                continue
            try:
                ast.parse(head_d + body_d)
            except SyntaxError:
                continue
            rows.append({"origin": f.origin, "file": f.path, "function": node.name, "prompt": head_d, "reference": body_d})
            taken += 1
            if taken == per_file:
                break
    rows = rows[:count]
    for i, row in enumerate(rows):
        row["id"] = f"code-{i:03d}"
    return rows


def _prose(paragraph: str) -> bool:
    letters = sum(c.isalpha() or c == " " for c in paragraph)
    return len(paragraph) >= 240 and letters / len(paragraph) > 0.9 and not re.search(r"[{}<>|=_*#`\\]|http", paragraph)


def _paragraphs(text: str):
    for block in re.split(r"\n\s*\n", text):
        para = " ".join(line.strip() for line in block.splitlines())
        if _prose(para):
            yield para


def text_prompts(count: int, prompt_chars: int) -> list[dict]:
    sources = []
    for path in sorted(Path("/usr/share/doc").glob("*/README*")):
        try:
            raw = gzip.open(path, "rt", errors="replace").read() if path.suffix == ".gz" else path.read_text(errors="replace")
        except OSError:
            continue
        sources.append((str(path), raw))
    for dist in sorted(md.distributions(), key=lambda d: d.metadata["Name"] or ""):
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        sources.append((f"{dist.metadata['Name']}/METADATA", body))
    rows, seen = [], set()
    for source, raw in sources:
        for para in list(_paragraphs(raw))[:2]:
            if para in seen:
                continue
            seen.add(para)
            cut = para[:prompt_chars]
            cut = cut[: cut.rfind(" ")] if " " in cut else cut
            rows.append({"source": source, "prompt": cut, "reference": para[len(cut) :].strip()})
    rows.sort(key=lambda r: _h(r["source"] + r["prompt"]))
    rows = rows[:count]
    for i, row in enumerate(rows):
        row["id"] = f"text-{i:03d}"
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": r.pop("id"), **r}) + "\n" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-pycoder")
    ap.add_argument("--out", default="benchmarks/prompts")
    ap.add_argument("--code", type=int, default=120)
    ap.add_argument("--text", type=int, default=60)
    args = ap.parse_args()
    code = code_prompts(Path(args.model), args.code, per_file=3, max_prompt_chars=1200)
    text = text_prompts(args.text, prompt_chars=220)
    write_jsonl(Path(args.out) / "code.jsonl", code)
    write_jsonl(Path(args.out) / "text.jsonl", text)
    print(f"{len(code)} code prompts, {len(text)} text prompts written to {args.out}")


if __name__ == "__main__":
    main()

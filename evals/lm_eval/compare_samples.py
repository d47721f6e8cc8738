"""Per-sample agreement of two lm-eval runs (--log_samples): loglikelihoods and generations.

    python -m evals.lm_eval.compare_samples /tmp/lm-eval-compare/server /tmp/lm-eval-compare/hf
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def samples(root: str, task: str) -> dict[int, dict]:
    files = sorted(Path(root).rglob(f"samples_{task}_*.jsonl"))
    if not files:
        sys.exit(f"no samples of {task} under {root}")
    return {s["doc_id"]: s for s in map(json.loads, files[-1].read_text().splitlines())}


def main(argv: list[str] | None = None) -> None:
    a_root, b_root = (argv if argv is not None else sys.argv[1:])[:2]
    for task in ("ls_capitals", "ls_arithmetic"):
        a, b = samples(a_root, task), samples(b_root, task)
        if sorted(a) != sorted(b):
            sys.exit(f"{task}: the runs scored different documents")
        if task == "ls_capitals":
            diffs, same_pick, same_greedy = [], 0, 0
            for i in a:
                la = [float(r[0][0]) for r in a[i]["resps"]]
                lb = [float(r[0][0]) for r in b[i]["resps"]]
                diffs += [abs(x - y) for x, y in zip(la, lb)]
                same_pick += la.index(max(la)) == lb.index(max(lb))
                same_greedy += [r[0][1] for r in a[i]["resps"]] == [r[0][1] for r in b[i]["resps"]]
            print(f"{task}: {len(a)} docs, {len(diffs)} loglikelihoods, max |difference| {max(diffs):.2e}, "
                  f"same choice {same_pick}/{len(a)}, same is_greedy flags {same_greedy}/{len(a)}, "
                  f"acc {sum(s['acc'] for s in a.values()) / len(a):.3f} vs {sum(s['acc'] for s in b.values()) / len(b):.3f}")
        else:
            same = sum(a[i]["resps"] == b[i]["resps"] for i in a)
            print(f"{task}: {len(a)} docs, identical generations {same}/{len(a)}, exact_match "
                  f"{sum(s['exact_match'] for s in a.values()) / len(a):.3f} vs "
                  f"{sum(s['exact_match'] for s in b.values()) / len(b):.3f}")


if __name__ == "__main__":
    main()

"""Benchmark prompt sets: JSONL rows with `prompt` (text) or `input_ids`, tokenized as a user would send them."""
from __future__ import annotations

import json
from pathlib import Path


def read_prompt_set(path: str | Path, tokenizer, count: int | None = None, chat: bool = False) -> list[list[int]]:
    """Token ids of the set's prompts; `count` takes evenly spaced rows (so every category of a sorted
    set is in); `chat` sends each prompt as one user turn through the tokenizer's chat template."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if count is not None and count < len(rows):
        rows = [rows[i * len(rows) // count] for i in range(count)]
    prompts = []
    for row in rows:
        if "input_ids" in row:
            prompts.append([int(t) for t in row["input_ids"]])
        elif tokenizer is None:
            raise ValueError(f"{path} holds text prompts but the model has no tokenizer")
        elif chat:
            messages = [{"role": "user", "content": row["prompt"]}]
            prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False))
        else:
            prompts.append(tokenizer(row["prompt"])["input_ids"])
    return prompts

"""The default model, SmolLM2-135M-Instruct, from the installed GGUF: exact in float32, bf16 by `auto`."""
import pytest
import torch

from lookahead_core import LookaheadParams, generate
from lookahead_core.cli.prompt_sets import read_prompt_set
from lookahead_core.models.loading import DEFAULT_MODEL, load_model, native_bf16
from tests.fixtures import PROMPTS

pytestmark = pytest.mark.slow  # the real default model


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return load_model(DEFAULT_MODEL, dtype="float32")


def hf_greedy(model, ids: list[int], max_new: int) -> list[int]:
    x = torch.tensor([ids])
    return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False)[0, len(ids):].tolist()


@pytest.mark.parametrize("prompts, chat", [("chat.jsonl", True), ("code.jsonl", False)])
def test_lookahead_is_token_identical_to_hf_greedy_in_float32(fp32, prompts, chat):
    model, tok = fp32
    steps = tokens = 0
    for ids in read_prompt_set(PROMPTS / prompts, tok, count=3, chat=chat):
        ref = hf_greedy(model, ids, 40)
        whole = generate(model, torch.tensor([ids]), max_new_tokens=40, params=LookaheadParams(3, 2, 2, adapt=False))
        assert whole.tokens == ref
        steps, tokens = steps + whole.stats.steps, tokens + len(whole.tokens)
        paced = generate(model, torch.tensor([ids]), max_new_tokens=40, params=LookaheadParams(3, 2, 2))
        assert paced.tokens == ref
    assert tokens / steps > 1.1  # real n-gram hits on real text, not a trivially plain run


def test_auto_dtype_follows_the_cpu():
    model, tok = load_model(DEFAULT_MODEL)  # dtype auto
    assert model.dtype == (torch.bfloat16 if native_bf16("cpu") else torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    res = generate(model, torch.tensor([ids]), max_new_tokens=16, params=LookaheadParams(3, 2, 2))
    assert "Paris" in tok.decode(res.tokens)

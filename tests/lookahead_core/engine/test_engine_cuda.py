"""The engine on a CUDA GPU, eager: exact greedy tokens, seeded draws, and the KV fitted to GPU memory."""
import pytest
import torch

from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.lookahead.sampling import SamplingParams
from lookahead_core.models.random_models import build_random_model
from tests.lookahead_core.helpers import req, run_to_end, well_conditioned_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 256
ENGINE = dict(max_batch=4, max_seq_len=160, max_new_tokens=32, prefill_chunk=16)


@pytest.fixture(scope="module")
def model():
    return build_random_model("llama", vocab_size=VOCAB).cuda()


def test_float32_on_cuda_gives_hf_greedy_tokens(model):
    """Plain, default and wide lookahead rows batched together: Hugging Face's greedy tokens."""
    cases = well_conditioned_cases(model, 6, VOCAB, seed=3, max_new_tokens=24)
    modes = ["off", "auto", LookaheadParams(4, 3, 3, lookup=4)]
    engine = Engine(model, EngineConfig(**ENGINE))
    assert engine.runner.cache.device.type == "cuda"
    requests = [req(i, prompt, 24, modes[i % 3], eos=()) for i, (prompt, _) in enumerate(cases)]
    out = run_to_end(engine, requests)
    assert out == {i: ref for i, (_, ref) in enumerate(cases)}


def test_a_seed_fixes_the_draws_on_cuda_alone_or_batched(model):
    prompt = [5, 9, 5, 9, 17, 3, 5, 9]
    sampling = SamplingParams(1.0, top_p=0.9, seed=42)
    alone = run_to_end(Engine(model, EngineConfig(**ENGINE)), [req(0, prompt, 24, LookaheadParams(3, 2, 2), sampling=sampling)])
    others = [req(i, [40 + i, 41, 42, 7], 24, "auto") for i in range(1, 4)]
    batched = run_to_end(Engine(model, EngineConfig(**ENGINE)), [*others, req(0, prompt, 24, "off", sampling=sampling)])
    assert len(alone[0]) == 24 and batched[0] == alone[0]


def test_the_kv_budget_is_a_share_of_free_gpu_memory(model):
    free = torch.cuda.mem_get_info()[0]
    engine = Engine(model, EngineConfig(**ENGINE, kv_cache_memory=0.001))
    plan = engine.kv_plan
    # the learned tables are host memory: they are not taken from the GPU's
    assert plan.learned_bytes > 0 and abs(plan.budget_bytes - 0.001 * free) < 0.0001 * free
    assert plan.slots == min(4, (plan.budget_bytes - plan.reserved_bytes) // plan.bytes_per_slot)

"""AutoLookahead on a real engine: the router's choice reaches "auto" requests, and what they
accept comes back to the router."""
import torch

from lookahead_core import LookaheadParams
from lookahead_core.engine.config import EngineConfig
from lookahead_core.engine.engine import Engine
from lookahead_core.models.random_models import build_random_model
from lookahead_core.policy.auto import AutoLookahead
from lookahead_core.policy.controller import LookaheadPolicy, PolicyConfig
from tests.lookahead_core.policy.test_controller import cpu_like_profile


def test_auto_requests_run_the_choice_and_feed_back_their_acceptance():
    torch.manual_seed(0)
    engine = Engine(build_random_model("llama", vocab_size=64), EngineConfig(max_batch=4, max_new_tokens=40))
    router = LookaheadPolicy(PolicyConfig(profile="x.yaml", min_dwell_steps=0, learn_after_steps=1),
                             profile=cpu_like_profile(), costs=engine.runner.costs)
    auto = AutoLookahead(router)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    for i in range(2):
        engine.add_request(i, prompt, max_new_tokens=40, params=auto.register(i), eos_token_id=[])
    engine.add_request("off", prompt, max_new_tokens=40, params=None, eos_token_id=[])
    seen, steps = set(), {}
    while engine.has_work():
        auto.before_step(engine)
        seen |= {p for seq_id, (p, *_) in engine.running_progress().items() if seq_id != "off"}
        for out in engine.step():
            if out.finish_reason is not None:
                steps[out.seq_id] = out.stats["steps"]
                auto.forget(out.seq_id)
    assert seen and all(isinstance(p, LookaheadParams) or p is None for p in seen)
    learned = {k: v for k, v in router._learned.items()}
    assert learned, "nothing fed back"
    total = sum(v[0] for v in learned.values())
    # Every auto step is counted but each request's first (before its first look) and last (it
    # finishes before the next look).
    assert steps[0] + steps[1] - 4 <= total <= steps[0] + steps[1]
    assert all(1.0 <= comp <= 8 and tokens >= 1.0 for _, comp, tokens in learned.values())
    assert router.cost_scale != 1.0  # the engine's forwards were folded in
    assert auto._progress == {}

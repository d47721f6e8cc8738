"""The profile CLI's measurements run through the engine, the path replicas decode on."""
from lookahead_core import LookaheadParams, ModelRunner
from lookahead_core.cli.profile import measure_settings
from lookahead_core.models.random_models import build_random_model


def test_compression_is_measured_with_the_shared_pool_a_replica_keeps():
    """Prompts decoded one after the other, as a replica would: a repeated prompt then finds the
    first decode's output in the shared pool. Each setting starts from an empty pool."""
    runner = ModelRunner(build_random_model("llama"))
    prompt = [5, 9, 3, 7, 11, 2]
    params = [LookaheadParams(3, 2, 2), LookaheadParams(3, 2, 2)]
    alone = measure_settings(runner, [prompt, prompt], params[:1], 24, lambda what: None)
    shared = measure_settings(runner, [prompt, prompt], params, 24, lambda what: None, shared_pool_cap=8)
    assert [s.label for s in shared] == ["plain", "(3,2,2)", "(3,2,2)"]
    assert shared[1].compression == shared[2].compression  # cleared between settings
    assert shared[1].compression > alone[1].compression * 1.3
    assert 1 < alone[1].step_tokens <= params[0].max_step_tokens


def test_profile_cli_writes_a_profile_the_policy_can_load(tmp_path):
    import json

    from lookahead_core.cli.profile import main
    from lookahead_core.policy.cost_profile import StepCostProfile

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [3 + i, 9, 4, 7]}) for i in range(3)))
    out = tmp_path / "profile.yaml"
    assert main(["--model", "random:tiny", "--dtype", "float32", "--prompts", str(prompts), "--num-prompts", "2",
                 "--batch-sizes", "1,2", "--tokens", "1,4", "--settings", "3,2,2", "--repeats", "1",
                 "--max-new-tokens", "4", "--out", str(out)]) == 0
    profile = StepCostProfile.load(out)
    assert profile.dtype == "float32" and profile.batch_sizes == [1, 2] and profile.tokens == [1, 4]
    assert [s.label for s in profile.settings] == ["plain", "(3,2,2)"]
    assert all(ms > 0 for row in profile.latency_ms for ms in row)

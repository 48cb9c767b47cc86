# Quick start: `make demo` and `make test` each set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch, jax and jaxlib first and pinned (pyproject.toml states ranges): the CPU wheels these
	# machines test, so nothing can pull a CUDA build or a newer jax in their place.
	$(PY) -m pip install -q torch==2.13.0 jax==0.10.2 jaxlib==0.10.2
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

$(VENV)/.bench: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

demo: setup
	$(PY) bench/demo.py

test: setup
	$(PY) -m pytest -q

bench: $(VENV)/.bench
	$(PY) bench/inference.py

clean:
	rm -rf $(VENV) build *.egg-info

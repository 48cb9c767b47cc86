# Quick start: `make demo` and `make test` each set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup kernels demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch, jax and jaxlib first and pinned (pyproject.toml states ranges): the CPU wheels these
	# machines test, so nothing can pull a CUDA build or a newer jax in their place.
	$(PY) -m pip install -q torch==2.13.0 jax==0.10.2 jaxlib==0.10.2
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# torch's CPU kernels for XLA:CPU executables, compiled against the torch and jaxlib just
# installed (a no-op once built; without a C++ compiler fx2xla uses XLA's kernels and says why).
kernels: $(VENV)/.installed
	$(PY) -m fx2xla kernels build --optional

setup: $(VENV)/.installed kernels

$(VENV)/.bench: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

demo: setup
	$(PY) bench/demo.py

# Two pytest workers (CI has 2 cores; most of a test is compiling, single-threaded), then the
# tests marked `serial`, which watch other threads' CPU time and need the cores to themselves
# (pytest's exit status 5, "no tests collected", is not a failure there).
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow and not serial"
	$(PY) -m pytest -q -m "serial and not slow" || [ $$? -eq 5 ]

bench: $(VENV)/.bench
	$(PY) bench/inference.py

clean:
	rm -rf $(VENV) build *.egg-info fx2xla/csrc/build

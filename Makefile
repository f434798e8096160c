# Two commands for a newcomer: `make run` (the main job) and `make test` (lint + tests).
# Both create .venv and install the pinned versions from constraints.txt first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed

.PHONY: setup run test lint bench clean

# What the main job needs (torch, Flower, fedcomp), then what the tests add (pytest, ruff, ..., triton).
$(RUNTIME): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e .
	touch $(RUNTIME)

$(STAMP): $(RUNTIME)
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,gpu]"
	touch $(STAMP)

setup: $(STAMP)

run: $(RUNTIME)
	$(BIN)/fedcomp sim

# ruff, then the package rules (pyproject.toml [tool.importlinter]: only fedcomp.flower imports Flower, ...)
lint: $(STAMP)
	$(BIN)/ruff check fedcomp clients server_app simulations tests benchmarks examples
	$(BIN)/lint-imports --no-cache

# Unit, property and hostile-input tests in parallel, then the end-to-end tests (Ray, SuperLink) one at a time.
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow"
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_bytes.py
	$(BIN)/python benchmarks/bench_speed.py

clean:
	rm -rf $(VENV) results .pytest_cache .hypothesis

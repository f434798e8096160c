# Two commands for a newcomer: `make run` (the main job) and `make test` (lint + tests).
# Both create .venv and install the pinned versions from constraints.txt first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed

.PHONY: setup run test lint bench clean

# What the main job needs (torch, Flower, fedcomp), then what the tests add (pytest, ruff, ..., triton).
# Everything through uv (the pinned versions, downloaded, unpacked and byte-compiled in parallel): 39-52 s for the
# runtime on 2 cores, against 40-64 s with torch through pip and 95-120 s with pip alone (docs/results.md). uv does
# not read pip's configuration, so the find-links locations pip is configured with (where a local torch build may
# be) are handed to it (UV_FIND_LINKS, unless already set). pip installs everything when uv is missing or fails.
# The venv is made without a pip of its own (under a second; ensurepip takes 6-10 s): the interpreter's pip installs
# into it (pip >= 22.3: --python); where that pip is older or missing, the venv gets its own. $(VENV)/.pip says which.
FIND_LINKS = $$($(PIP) config list 2> /dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$$/\1/p" | tr ' ' '\n' | sort -u | paste -sd, -)
UV = UV_FIND_LINKS="$${UV_FIND_LINKS:-$(FIND_LINKS)}" $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -c constraints.txt
PIP = $$(cat $(VENV)/.pip 2> /dev/null || echo $(BIN)/python -m pip)

$(RUNTIME): pyproject.toml constraints.txt
	$(PY) -m venv --without-pip $(VENV)
	if $(PY) -m pip --python $(BIN)/python --version > /dev/null 2>&1; then echo "$(PY) -m pip --python $(BIN)/python" > $(VENV)/.pip; \
	else $(BIN)/python -m ensurepip > /dev/null && echo "$(BIN)/python -m pip" > $(VENV)/.pip; fi
	$(PIP) install -q -c constraints.txt uv || echo "(no uv: installing with pip)"
	$(UV) -e . || $(PIP) install -q -c constraints.txt -e .
	touch $(RUNTIME)

$(STAMP): $(RUNTIME)
	$(UV) -e ".[dev,gpu]" || $(PIP) install -q -c constraints.txt -e ".[dev,gpu]"
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

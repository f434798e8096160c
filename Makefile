# Two commands for a newcomer: `make run` (the main job) and `make test` (lint + tests).
# Both create .venv and install the pinned versions from constraints.txt first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed

.PHONY: setup run test test-flwr142 lint bench clean

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

# Unit, property and hostile-input tests in parallel, then the end-to-end tests (Ray, SuperLink) one at a time, then
# the Flower path again on the other supported Flower (test-flwr142).
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow"
	$(BIN)/python -m pytest -q -m slow
	$(MAKE) --no-print-directory test-flwr142

# flwr 1.42.0 in a second environment, .venv-flwr142: constraints.txt with the lines of constraints-flwr142.txt in
# place of those of the same names (flwr and the uv and certifi it requires), installed by the same uv from the same
# cache (30 s; byte-compiled like .venv, so that each process importing torch and flwr starts 2.4 s sooner). It runs
# the Flower path: the mod and Compressed (both loops) on Flower's records and grids, the SuperExec and flwr-clientapp hooks, warm
# workers, then two end-to-end runs (run_simulation on Ray; a loopback deployment through both launchers with
# density=auto). FEDCOMP_CONSTRAINTS tells test_flower_versions.py which flwr must be the one imported.
VENV142 := .venv-flwr142
FLOWER_TESTS := tests/test_flower_versions.py tests/test_flower_api.py tests/test_prompt_grid.py tests/test_grid_reads.py \
	tests/test_prestart.py tests/test_superexec_poll.py tests/test_worker.py tests/test_flower_async.py \
	tests/test_client_state.py tests/test_warm_app.py tests/test_mod_node.py tests/test_product_path.py \
	tests/test_flower_async_state.py tests/test_flower_sync_loop.py
FLOWER_E2E := tests/test_flower_api_sim.py tests/test_deployment.py::test_auto_density_reaches_real_supernodes
XDIST ?= -n 2 --dist loadfile

$(VENV142)/.installed: $(RUNTIME) pyproject.toml constraints.txt constraints-flwr142.txt
	rm -rf $(VENV142) && $(PY) -m venv --without-pip $(VENV142)
	sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/^\1==/p' constraints-flwr142.txt > $(VENV142)/overridden
	{ grep -v -i -f $(VENV142)/overridden constraints.txt; grep '==' constraints-flwr142.txt; } > $(VENV142)/constraints.txt
	UV_FIND_LINKS="$${UV_FIND_LINKS:-$(FIND_LINKS)}" $(BIN)/uv pip install -q --compile-bytecode \
		--python $(VENV142)/bin/python -c $(VENV142)/constraints.txt -e ".[dev,gpu]" \
	|| $(PY) -m pip --python $(VENV142)/bin/python install -q -c $(VENV142)/constraints.txt -e ".[dev,gpu]"
	touch $@

test-flwr142: $(VENV142)/.installed
	FEDCOMP_CONSTRAINTS=$(VENV142)/constraints.txt $(VENV142)/bin/python -m pytest -q $(XDIST) -m "not slow" \
		$(FLOWER_TESTS)
	$(VENV142)/bin/python -m pytest -q $(FLOWER_E2E)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_bytes.py
	$(BIN)/python benchmarks/bench_speed.py

clean:
	rm -rf $(VENV) $(VENV142) results .pytest_cache .hypothesis

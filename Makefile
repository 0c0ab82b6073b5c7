# Two entry points: `make demo` (install + main job on defaults) and `make test` (install + whole suite).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install horovod demo test bench clean

$(STAMP): pyproject.toml
	@echo "[make] creating $(VENV) and installing the project (torch pinned to 2.13.0)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,experiments]'
	@touch $(STAMP)

# Horovod 0.28.1 built from its sdist against the pinned torch (C++17 patch, Gloo, no MPI/TF/MXNet).
# First run ~3 min on 2 cores with progress; later runs reuse ~/.cache/ina-emu/wheels/ in seconds, and
# a matching installed build is detected in ~3 s. Also installs the INA_SWITCH autopatch hook.
horovod: $(STAMP)
	$(PY) -m gloo_patch.install_horovod

install: $(STAMP) horovod

demo: install
	$(PY) -m experiments.demo
	$(PY) -m experiments.sweep --quick

test: install
	$(PY) -m pytest -q --durations=25 tests

bench: install
	$(PY) -m experiments.bench_codecs --json

clean:
	rm -rf $(VENV) build *.egg-info

# Two entry points: `make demo` (install + main job on defaults) and `make test` (install + whole suite).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	@echo "[make] creating $(VENV) and installing the project (torch pinned to 2.13.0)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,experiments]'
	@touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m experiments.demo

test: install
	$(PY) -m pytest -q tests

bench: install
	$(PY) -m experiments.bench_codecs --json

clean:
	rm -rf $(VENV) build *.egg-info

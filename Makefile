# Every target forwards variables to Hydra; no hyperparameters live here.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.DEFAULT_GOAL := help
.PHONY: help install test lint

help:  ## list the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-14s %s\n", $$1, $$2}'

install: $(VENV)/.installed  ## make .venv and install the package with its dev tools

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

test: install  ## run the test suite (tiny models, no downloads)
	$(PY) -m pytest -q

lint: install  ## ruff
	$(PY) -m ruff check src tests scripts

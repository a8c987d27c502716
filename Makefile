# Every target forwards variables to Hydra; no hyperparameters live here.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.DEFAULT_GOAL := help
.PHONY: help install test lint glue smoke

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

# make glue: each variable becomes a Hydra override only when given; the defaults (cola,
# roberta-base, gaussian, rho 0.1, seed 1) live in configs/. ARGS takes any other overrides.
TASK   ?=
MODEL  ?=
SKETCH ?=
RHO    ?=
SEED   ?=
ARGS   ?=

glue: install  ## fine-tune one GLUE run: make glue TASK=cola RHO=0.1 SKETCH=gaussian MODEL=roberta-base SEED=1 ARGS='train=cpu'
	$(PY) -m sketchprop.train $(if $(TASK),task=$(TASK)) $(if $(MODEL),model=$(MODEL)) \
		$(if $(SKETCH),method=$(SKETCH)) $(if $(RHO),method.rho=$(RHO)) \
		$(if $(SEED),train.seed=$(SEED)) $(ARGS)

smoke: install  ## tiny random RoBERTa end to end on toy GLUE files in a temp dir (about a minute)
	@tmp=$$(mktemp -d) && \
	$(PY) -m sketchprop.glue $$tmp/glue && \
	$(PY) -m sketchprop.train experiment=smoke data.glue_dir=$$tmp/glue hydra.run.dir=$$tmp/run \
		results_dir=$$tmp/results checkpoints_dir=$$tmp/checkpoints $(ARGS) && \
	echo "smoke: $$tmp/run/result.json"

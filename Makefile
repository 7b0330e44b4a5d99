# Two commands for a fresh clone:  `make demo` and `make test`.
# Each creates .venv and installs the pinned requirements the first time; later runs are fast.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.memfit-installed
# The optional extras (transformers, accelerate, lightning, torchvision, timm) live in a second
# environment: torchvision from PyPI needs torch 2.14.1, while the core suite keeps torch 2.13.0
# and runs without them.
EXTRAS_VENV ?= .venv-extras
EXTRAS_STAMP := $(EXTRAS_VENV)/.memfit-installed
EXTRAS_TESTS := tests/integrations/test_hf.py tests/integrations/test_peft_estimate.py tests/integrations/test_loss_head_hf.py tests/integrations/test_vision.py tests/integrations/test_zoo.py \
	tests/integrations/test_hf_trainer.py tests/integrations/test_lightning_accelerate.py tests/integrations/test_flops_stand_ins_zoo.py \
	tests/integrations/test_readme_extras.py tests/integrations/test_hf_compile.py \
	tests/integrations/test_plan_room_hf.py tests/integrations/test_hf_cache_flags.py \
	tests/integrations/test_docs_shell_extras.py tests/integrations/test_estimate_fallbacks.py \
	tests/integrations/test_levers_frozen_peft.py tests/integrations/test_peft.py \
	tests/integrations/test_peft_plan.py tests/integrations/test_peft_loops.py \
	tests/integrations/test_peft_train.py tests/integrations/test_peft_refusals.py \
	tests/integrations/test_order_zoo.py tests/integrations/test_hf_checkpointing_spelling.py \
	tests/integrations/test_zoo_twin_memory.py \
	tests/checkpointing_ported/test_ported_transformers.py tests/test_docs_names.py \
	tests/integrations/test_tiled_mlp_hf.py tests/integrations/test_twin_hf_mask.py \
	tests/integrations/test_longest_sequence_hf.py
# The newest releases a user gets today (requirements-newest.txt: torch 2.15.0, transformers 5.25.0,
# accelerate 1.16.0, peft, torchao) in a third environment, and a small suite run there: checkpointing
# exactness (saved-tensor hooks included), plan + prepare + train_step, estimate, the Hugging Face
# Trainer (its activation_checkpointing spellings), peft and Lightning paths, memfit train on hf:
# models. It stays small, so that make test's three suites fit 30 minutes on 2 cores. pip's cap on
# torch on this machine (/etc/xdg/pip) is lifted for that one install by an empty constraints file.
NEWEST_VENV ?= .venv-newest
NEWEST_STAMP := $(NEWEST_VENV)/.memfit-installed
NEWEST_TESTS := tests/test_checkpointing.py tests/test_checkpointing_inplace.py tests/test_checkpointing_hooks.py \
	tests/test_loop.py tests/planning/test_plan_api.py tests/test_estimate.py \
	tests/integrations/test_hf_trainer.py tests/integrations/test_hf_checkpointing_spelling.py \
	tests/integrations/test_hf.py::test_huggingface_checkpointing_is_detected_not_doubled \
	tests/integrations/test_hf.py::test_memfit_train_hf_config_name_and_local_directory \
	tests/integrations/test_peft_loops.py

.PHONY: demo test lint typecheck unit extras newest bench clean

$(STAMP): requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e . || $(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

$(EXTRAS_STAMP): requirements-extras.txt pyproject.toml
	$(PYTHON) -m venv $(EXTRAS_VENV)
	$(EXTRAS_VENV)/bin/python -m pip install --quiet -r requirements-extras.txt
	$(EXTRAS_VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e . || $(EXTRAS_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(EXTRAS_STAMP)

$(NEWEST_STAMP): requirements-newest.txt pyproject.toml
	$(PYTHON) -m venv $(NEWEST_VENV)
	PIP_CONSTRAINT=/dev/null $(NEWEST_VENV)/bin/python -m pip install --quiet --no-deps -r requirements-newest.txt
	$(NEWEST_VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(NEWEST_STAMP)

demo: $(STAMP)
	$(BIN)/memfit demo $(ARGS)

test: lint typecheck unit extras newest

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy src

# Two workers (XDIST=0 runs in one process); a test file stays on one worker, in its order, with its
# module fixtures built once (the docs' shell blocks share one clone).
XDIST ?= 2
XDIST_ARGS := $(if $(filter 0,$(XDIST)),,-n $(XDIST) --dist loadfile)

# Tests marked busy load every core themselves (two spinning processes) and ask that the plans
# repeat under that load, not under a second test worker's too: they run alone, after the rest.
unit: $(STAMP)
	$(BIN)/pytest -q $(XDIST_ARGS) -m "not busy" $(PYTEST_ARGS)
	$(BIN)/pytest -q -p no:cacheprovider -m busy $(PYTEST_ARGS)

# The tests that need the extras; in .venv (without them) they are skipped with a reason.
extras: $(EXTRAS_STAMP)
	HF_HUB_OFFLINE=1 $(EXTRAS_VENV)/bin/pytest -q -p no:cacheprovider $(XDIST_ARGS) -m "not busy" $(EXTRAS_TESTS)
	HF_HUB_OFFLINE=1 $(EXTRAS_VENV)/bin/pytest -q -p no:cacheprovider -m busy $(EXTRAS_TESTS)

# The newest-stack suite; its FutureWarnings are shown, none filtered (pyproject.toml fails memfit's own).
newest: $(NEWEST_STAMP)
	HF_HUB_OFFLINE=1 $(NEWEST_VENV)/bin/python -c "import torch, transformers; print('newest stack: torch', torch.__version__, 'transformers', transformers.__version__)"
	HF_HUB_OFFLINE=1 $(NEWEST_VENV)/bin/pytest -q -p no:cacheprovider $(NEWEST_TESTS)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_foundation.py

clean:
	rm -rf $(VENV) $(EXTRAS_VENV) $(NEWEST_VENV) .pytest_cache .mypy_cache .ruff_cache

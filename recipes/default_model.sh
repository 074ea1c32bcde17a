#!/usr/bin/env bash
# The built-in model (blockdecode.DEFAULT_MODEL) from nothing but Python source already on the machine (the
# standard library, torch and transformers): corpus and tokenizer, a 10.2M-parameter Llama trained on 42.6M
# tokens (4x the first built-in base), proposal heads trained three ways (the paper's, and sequential heads on
# hard and soft targets), the paper's table, the heads with the longest exact blocks shipped in bf16, and a
# one-layer draft model for the benchmark. The base alone is about 2.5 hours on 2 cores with native bf16, the
# heads about 10 minutes each (minutes in all on a GPU). Training resumes: run it again after an interruption and
# finished runs are skipped, a stopped one continues from its last checkpoint; the table is measured anew.
#
#   SHIP=1 bash recipes/default_model.sh     # RUNS=runs by default; SHIP=1 copies the winner into the package
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
RUNS=${RUNS:-runs}
BD=".venv/bin/blockdecode --threads ${THREADS:-2}"
K=10

# 1. Corpus (file-level held-out split, byte-level BPE of 8192) and the base model: 5200 steps of 16 x 512 tokens
#    (4 x 384: measured ahead of 6 x 384 at equal FLOPs, docs/results.md), bf16 where the CPU has
#    it natively.
[ -f "$RUNS/base/model/config.json" ] || $BD pretrain --corpus "$RUNS/corpus" --out "$RUNS/base" --resume \
  --layers 4 --steps "${BASE_STEPS:-5200}" --warmup-steps 100 --eval-every 200 --checkpoint-every 25
# Does it write code a reader recognises: loops in its greedy text, held-out loss per token and per byte.
.venv/bin/python benchmarks/base_quality.py --model "$RUNS/base/model" --corpus "$RUNS/corpus"

# 2. Heads for k=10 (smaller k use heads 2..k), distilled from the base's own greedy text, trained on its
#    cached decoder outputs over a draft vocabulary of the 1,024 most frequent targets: the paper's heads, and
#    sequential (hydra) heads on hard and on soft targets at a quarter of their data, the budget they were compared at.
HEADS=(--mode distill --k $K --steps "${HEAD_STEPS:-600}" --batch-size 16 --seq-len 256 --lr 2e-3 --warmup-steps 20
  --eval-every 100 --checkpoint-every 50 --draft-vocab 1024 --feature-cache "$RUNS/features"
  --distill-prompts 4096 --distill-new-tokens 160 --distill-batch-size 64 --distill-cache "$RUNS/distill-cache" --resume)
run_heads() {  # NAME, then the options that make it differ
  local name=$1; shift
  [ -f "$RUNS/$name/blockdecode.json" ] || $BD train --base "$RUNS/base/model" --data "$RUNS/corpus/train.npy" \
    --out "$RUNS/$name" "${HEADS[@]}" "$@"
}
# The shipped set: the paper's heads on four times the prompts (2.6M distilled tokens), 2,400 steps (about
# 1 h 50 min on one core: distillation 45 min, features 20, training 50).
run_heads heads-distill --head-type paper --head-hidden-size 128 --distill-prompts 16384 --steps 2400 --eval-every 200
run_heads heads-hydra --head-type hydra --head-hidden-size 256
run_heads heads-hydra-soft --head-type hydra --head-hidden-size 256 --targets soft

# 3. The paper's table on held-out stdlib files and unseen third-party code, written to
#    benchmarks/results/paper_table.* and docs/results.md; SHIP=1 also saves the heads with the largest mean
#    accepted block at k=8, and their base, into the package in bf16.
SHIP_ARGS=(); [ "${SHIP:-0}" = 1 ] && SHIP_ARGS=(--ship blockdecode/builtin/default_model)
.venv/bin/python benchmarks/paper_table.py --corpus "$RUNS/corpus" --out benchmarks/results/paper_table.json --doc \
  "${SHIP_ARGS[@]}" \
  --third-party --runs "$RUNS/heads-distill" "$RUNS/heads-hydra" "$RUNS/heads-hydra-soft"
if [ "${SHIP:-0}" = 1 ]; then  # what each drafter accepts on the shipped prompts, for `tree="auto"` anywhere
  .venv/bin/python - <<'PY'
import json, torch
from blockdecode import DEFAULT_MODEL, BlockwiseLM, calibrate
from transformers import AutoTokenizer
lm = BlockwiseLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
texts = json.load(open(f"{DEFAULT_MODEL}/prompts.json"))[:4]
calibrate.record_statistics(lm, [tok(t, return_tensors="pt").input_ids for t in texts], DEFAULT_MODEL)
PY
  # and each drafter's acceptance rates by source, the prior of tree="expected", on 16 held-out windows
  RUNS="$RUNS" .venv/bin/python - <<'PY'
import os, numpy as np, torch
from blockdecode import DEFAULT_MODEL, BlockwiseLM
from blockdecode.decoding.calibrate import record_rates
lm = BlockwiseLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
held = np.load(f"{os.environ['RUNS']}/corpus/heldout.npy", mmap_mode="r")
starts = np.linspace(0, len(held) - 200, 16).astype(np.int64)
record_rates(lm, [torch.tensor(held[s : s + 64].astype(np.int64))[None] for s in starts], DEFAULT_MODEL, 96)
PY
fi

# 4. The draft model for `blockdecode bench`'s assisted-generation baseline: one layer of 256 on the same corpus
#    and tokenizer, shipped in bf16 with SHIP=1.
[ -f "$RUNS/draft/model/config.json" ] || $BD pretrain --corpus "$RUNS/corpus" --out "$RUNS/draft" --resume \
  --layers 1 --hidden-size 256 --heads 4 --kv-heads 4 --intermediate-size 768 --steps 500
if [ "${SHIP:-0}" = 1 ]; then
  .venv/bin/python - "$RUNS/draft/model" blockdecode/builtin/draft_model <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).save_pretrained(sys.argv[2])
AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])
PY
fi

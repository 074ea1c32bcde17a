#!/usr/bin/env bash
# The built-in translation model's DFlash block drafter (issue 56): an encoder-decoder's block drafter, reading its
# decoder's layers 1, 2 and 3 (the source reaches them through cross-attention), trained on the model's own greedy
# translations of 16,384 training verses (what exact decoding verifies), blocks of 8 (one pass drafts 7 tokens),
# 2 layers sharing the base's output layer, 16 anchored blocks a verse, 2,000 steps of 32 verses; the base's
# features computed each step (a 10M model: cheaper than a cache of every verse's). Resumable: run it again.
# SHIP=1 copies the drafter into the package in bf16 (blockdecode/builtin/translation_model/dflash).
#
#   SHIP=1 bash recipes/translation_dflash.sh     # RUNS=runs by default; THREADS=2
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
RUNS=${RUNS:-runs}
RUN=${RUN:-$RUNS/translation-dflash}
RUNS=$RUNS bash recipes/bible.sh
[ -f "$RUN/blockdecode.json" ] || .venv/bin/blockdecode --threads "${THREADS:-2}" train \
  --base blockdecode/builtin/translation_model --data "$RUNS/bible/train.tsv" --out "$RUN" --head-type dflash \
  --mode distill --k 8 --dflash-layers 2 --anchors 16 --gamma 4 --steps "${STEPS:-2000}" --batch-size 32 \
  --seq-len 256 --lr 2e-3 --warmup-steps 50 --eval-every 250 --checkpoint-every 50 --eval-prompts 16 \
  --eval-new-tokens 200 --distill-prompts "${DISTILLED:-16384}" --distill-beams 1 --distill-new-tokens 200 \
  --distill-batch-size 64 --distill-cache "$RUNS/translation-dflash-distill" --resume
if [ "${SHIP:-0}" = 1 ]; then
  .venv/bin/python benchmarks/ship.py --dflash "$RUN" blockdecode/builtin/translation_model
fi

#!/usr/bin/env bash
# Two shorter DFlash runs beside recipes/dflash.sh's, to choose its shape by measurement (issue 56): one layer
# instead of two (blocks of 16), and blocks of 8 (two layers); 500 steps each, on the same distilled rows and
# cached features, so each compares with recipes/dflash.sh's run at step 500 (its metrics.jsonl). Resumable.
#
#   bash recipes/dflash_variants.sh     # then benchmarks/dflash_study.py --variant NAME=runs/dflash-NAME/dflash
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
RUNS=${RUNS:-runs}
BD=".venv/bin/blockdecode --threads ${THREADS:-1}"

for variant in "layers1 1 16" "block8 2 8"; do
  read -r name layers k <<< "$variant"
  [ -f "$RUNS/dflash-$name/blockdecode.json" ] || $BD train --base blockdecode/builtin/default_model \
    --data "$RUNS/e3/corpus/train.npy" --out "$RUNS/dflash-$name" --head-type dflash --mode distill --k "$k" \
    --dflash-layers "$layers" --anchors 16 --gamma 4 --steps 500 --batch-size 8 --seq-len 192 --lr 2e-3 \
    --warmup-steps 50 --eval-every 250 --checkpoint-every 50 --feature-cache "$RUNS/e3/features" \
    --distill-prompts 4096 --distill-new-tokens 160 --distill-batch-size 64 --distill-cache "$RUNS/e3/distill-cache" \
    --eval-prompts 8 --eval-new-tokens 96 --resume
done

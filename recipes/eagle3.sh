#!/usr/bin/env bash
# The built-in model's EAGLE-3 drafter (issue 49), from nothing but the standard library's source and the shipped
# model: the base's own greedy continuations of 4,096 stdlib windows (32 + 160 tokens; about 7 minutes on one
# core), the inputs of its layers 1, 2 and 3 cached (about 4 minutes), then 3,000 steps of 8 rows of the
# training-time test over 7 draft steps with a draft vocabulary of 2,048 (about 75 minutes on one core, bf16
# autocast where native). Resumable: run it again after an interruption. SHIP=1 copies the drafter into the
# package in bf16 (blockdecode/builtin/default_model/eagle3), with its training record; benchmarks/eagle3_study.py
# measures it.
#
#   SHIP=1 bash recipes/eagle3.sh     # RUNS=runs by default
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
RUNS=${RUNS:-runs}
BD=".venv/bin/blockdecode --threads ${THREADS:-1}"

[ -f "$RUNS/e3/corpus/train.npy" ] || .venv/bin/python -c "
from blockdecode import DEFAULT_MODEL
from blockdecode.pretraining.pretrain import CorpusConfig, prepare_corpus
prepare_corpus(CorpusConfig(out='$RUNS/e3/corpus', tokenizer=DEFAULT_MODEL, packages=()))"
[ -f "$RUNS/e3/eagle3/blockdecode.json" ] || $BD train --base blockdecode/builtin/default_model \
  --data "$RUNS/e3/corpus/train.npy" --out "$RUNS/e3/eagle3" --head-type eagle3 --mode distill --k 8 \
  --draft-vocab 2048 --steps 3000 --batch-size 8 --seq-len 192 --lr 2e-3 --warmup-steps 50 --eval-every 250 \
  --checkpoint-every 50 --feature-cache "$RUNS/e3/features" --distill-prompts 4096 --distill-new-tokens 160 \
  --distill-batch-size 64 --distill-cache "$RUNS/e3/distill-cache" --eval-prompts 8 --eval-new-tokens 96 --resume
if [ "${SHIP:-0}" = 1 ]; then
  .venv/bin/python benchmarks/ship.py --eagle3 "$RUNS/e3/eagle3" blockdecode/builtin/default_model
fi

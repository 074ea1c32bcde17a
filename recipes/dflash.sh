#!/usr/bin/env bash
# The built-in model's DFlash block drafter (issue 56), from nothing but the standard library's source and the
# shipped model: the base's own greedy continuations of 12,288 stdlib windows (32 + 160 tokens; recipes/eagle3.sh
# distils 4,096 drawn the same way) and the inputs of its layers 1, 2 and 3, cached once (about 14 GB).
# Blocks of 16 (one pass drafts 15 tokens), 2 Qwen3-style layers sharing the base's output layer (z-lab's layout
# holds it), 16 anchored blocks a row, 3,000 steps of 8 rows. Resumable: run it again after an interruption.
# SHIP=1 copies the drafter into the package in bf16 (blockdecode/builtin/default_model/dflash) with its record.
#
#   SHIP=1 THREADS=2 bash recipes/dflash.sh     # RUNS=runs by default; about an hour on 2 cores, 17 min of it steps
#   PROMPTS=4096 RUN=runs/dflash-4k bash recipes/dflash.sh   # the earlier drafter, on the EAGLE-3 recipe's rows
#   PACKAGES="torch transformers" CORPUS=runs/code/corpus RUN=runs/dflash-code bash recipes/dflash.sh
#       # windows drawn from the base's whole pretraining corpus (the stdlib and the packages' source), not stdlib alone
#   DATA="runs/e3/corpus/train.npy runs/code/corpus/train.npy" PROMPTS=24576 RUN=runs/dflash-mixed bash recipes/dflash.sh
#       # both (run the PACKAGES line first): windows drawn evenly over the two streams, about 40 % stdlib
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
RUNS=${RUNS:-runs}
BD=".venv/bin/blockdecode --threads ${THREADS:-1}"
RUN=${RUN:-$RUNS/dflash}
PROMPTS=${PROMPTS:-12288}
CORPUS=${CORPUS:-$RUNS/e3/corpus}
PACKAGES=${PACKAGES:-}

[ -f "$CORPUS/train.npy" ] || .venv/bin/python -c "
from blockdecode import DEFAULT_MODEL
from blockdecode.pretraining.pretrain import CorpusConfig, prepare_corpus
prepare_corpus(CorpusConfig(out='$CORPUS', tokenizer=DEFAULT_MODEL, packages=tuple('$PACKAGES'.split())))"
[ -f "$RUN/blockdecode.json" ] || $BD train --base blockdecode/builtin/default_model \
  --data ${DATA:-"$CORPUS/train.npy"} --out "$RUN" --head-type dflash --mode distill --k 16 \
  --dflash-layers 2 --anchors 16 --gamma 4 --steps 3000 --batch-size 8 --seq-len 192 --lr 2e-3 --warmup-steps 50 \
  --eval-every 250 --checkpoint-every 50 --feature-cache "$RUNS/e3/features" --distill-prompts "$PROMPTS" \
  --distill-new-tokens 160 --distill-batch-size 64 --distill-cache "$RUNS/e3/distill-cache" --eval-prompts 8 \
  --eval-new-tokens 96 --resume
if [ "${SHIP:-0}" = 1 ]; then
  .venv/bin/python benchmarks/ship.py --dflash "$RUN" blockdecode/builtin/default_model
fi

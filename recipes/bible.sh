#!/usr/bin/env bash
# The Bible verse pairs the translation recipes train on (recipes/translation.sh, recipes/translation_dflash.sh):
# the SWORD modules (Debian packages, fetched by apt like any package), English (King James) and Spanish
# (Reina-Valera 1909) verse pairs split by chapter, and the extra English sources distillation may use: the World
# English Bible's training verses and the sentences of three commentaries on training chapters
# (sources-web.txt, sources-mhcc.txt, ...). Skipped where $RUNS/bible is whole.
#
#   bash recipes/bible.sh     # RUNS=runs by default
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
RUNS=${RUNS:-runs}
EXTRA_SOURCES="web mhcc scofield tdavid"
if [ ! -f "$RUNS/bible/train.tsv" ] || [ ! -f "$RUNS/bible/sources-tdavid.txt" ]; then
  if [ ! -f "$RUNS/sword/usr/share/sword/mods.d/tdavid.conf" ]; then
    mkdir -p "$RUNS/sword"
    (cd "$RUNS/sword" && apt-get download sword-text-kjv sword-text-sparv sword-text-web sword-comm-mhcc sword-comm-scofield \
      sword-comm-tdavid && for f in sword-*.deb; do dpkg-deb -x "$f" .; done)
  fi
  .venv/bin/blockdecode bible --modules "$RUNS/sword/usr/share/sword" --out "$RUNS/bible" \
    --extra-sources "${EXTRA_SOURCES// /,}"
fi

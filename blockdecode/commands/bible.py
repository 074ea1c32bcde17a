"""`blockdecode bible`: the English-Spanish verse pairs the translation model trains on."""

from __future__ import annotations

import argparse
from pathlib import Path

from blockdecode.commands.flags import (
    comma_names,
)
from blockdecode.core.io import check_writable


def run(args: argparse.Namespace) -> None:
    from blockdecode.pretraining.bible import open_sources, read_pairs, read_sources, sources_file, write_corpus

    check_writable(Path(args.out))  # before the modules are read, not after
    extra = open_sources(args.modules, args.extra_sources)  # a module not there fails before any reading
    pairs = read_pairs(args.modules)
    sources = read_sources(extra, pairs)
    counts = write_corpus(pairs, args.out, sources)
    split = ", ".join(f"{name} {n:,}" for name, n in counts.items())
    print(f"{sum(counts.values()):,} verse pairs in {args.out}: {split}")
    for name, lines in sources.items():
        what = "sentences of commentary" if extra[name].commentary else "English verses"
        print(f"{len(lines):,} {what} on training chapters from {extra[name].name} in {sources_file(name)}")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bible",
        help="write the English-Spanish verse pairs (KJV, Reina-Valera 1909) for translation",
        description="Reads the engKJV2006eb and spaRV1909eb SWORD modules with pysword and writes train.tsv, "
        "valid.tsv and test.tsv (reference, English, Spanish), split by a hash of book and chapter. Get the "
        "modules with: apt-get download sword-text-kjv sword-text-sparv; dpkg-deb -x each .deb into DIR; then "
        "--modules DIR/usr/share/sword.",
    )
    p.add_argument("--modules", required=True, help="SWORD module folder (the one holding mods.d/)")
    p.add_argument("--out", default="runs/bible", help="where the .tsv files go")
    p.add_argument(
        "--extra-sources",
        type=comma_names,
        default=[],
        help="comma-separated English modules whose training-chapter text goes to OUT/sources-NAME.txt, one "
        "source a line, for train --distill-sources: web (World English Bible: sword-text-web), mhcc, scofield, "
        "tdavid (commentaries: sword-comm-*), or a module's own name",
    )
    p.set_defaults(func=run)

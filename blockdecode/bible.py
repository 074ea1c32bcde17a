"""English-Spanish verse pairs from two public-domain Bibles, the translation corpus.

The King James Bible and the Reina-Valera 1909 share the KJV versification, so verse i of one is
verse i of the other: about 31,000 pairs. Both come as SWORD modules, read with `pysword`. On
Debian or Ubuntu:

    apt-get download sword-text-kjv sword-text-sparv
    for f in sword-text-*.deb; do dpkg-deb -x "$f" sword; done   # modules in sword/usr/share/sword

elsewhere, unzip the modules' zip files from the SWORD project (crosswire.org) into one folder.

The split is by a hash of book and chapter: held-out verses are whole chapters the model never
saw, the same ones on every machine."""

from __future__ import annotations

import hashlib
import lzma
import re
import struct
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from blockdecode.io import read_utf8, saving_folder, write_text

ENGLISH, SPANISH = "engKJV2006eb", "spaRV1909eb"
HELD_OUT_VERSES = (  # from the test split (chapters a model trained on the training verses never saw)
    "And Moses said, Thou hast spoken well, I will see thy face again no more.",
    "And Joshua discomfited Amalek and his people with the edge of the sword.",
    "And thou shalt take no gift: for the gift blindeth the wise, and perverteth the words of the righteous.",
    "Three times in the year all thy males shall appear before the Lord GOD.",
)
SPLITS = {"valid": 2, "test": 5}  # percent of chapters; the rest is "train"
# How pysword fails on damaged module data: an index pointing past the text's end gives bytes where
# it expects str (TypeError), compressed blocks that do not decompress, records cut short.
DAMAGED_DATA = (TypeError, ValueError, LookupError, OSError, EOFError, struct.error, zlib.error, lzma.LZMAError)


@dataclass(frozen=True)
class VersePair:
    ref: str  # OSIS reference, e.g. "Gen.1.1"
    source: str  # English
    target: str  # Spanish

    @property
    def chapter(self) -> str:
        return self.ref.rsplit(".", 1)[0]


_TAG = re.compile(r"<[^>]*>")


def clean(text: str) -> str:
    """Markup the reader's own cleaning left removed: any tag, paragraph marks (KJV's ¶) and runs
    of whitespace."""
    return " ".join(_TAG.sub(" ", text).replace("\u00b6", " ").split())


_WORD = re.compile(r"\w+")


def undo_drop_cap(text: str, counts: Counter) -> str:
    """The RV1909 sets the first words of every chapter in capitals ("EN el principio", "Y HABLÓ
    Jehová", "Y JEHOVÁ dijo"). Each capitalised word of that leading run becomes whichever of its
    lower-case and capitalised forms the text itself uses more (`counts`: word frequencies), so a
    verb goes to lower case and a name keeps its capital; the verse's first word keeps its capital."""
    words = text.split(" ")
    for i, word in enumerate(words):
        core = _WORD.search(word)
        if core is None or not core.group().isupper():
            break
        if len(core.group()) < 2:
            continue
        lower, title = core.group().lower(), core.group().capitalize()
        form = title if i == 0 or counts[title] > counts[lower] else lower
        words[i] = word[: core.start()] + form + word[core.end() :]
    return " ".join(words)


def split_of(chapter: str) -> str:
    """'train', 'valid' or 'test' for an OSIS chapter ("Gen.1"), from a hash: stable everywhere."""
    bucket = int.from_bytes(hashlib.sha256(chapter.encode()).digest()[:4], "little") % 100
    edge = 0
    for name, percent in SPLITS.items():
        edge += percent
        if bucket < edge:
            return name
    return "train"


def read_pairs(modules: str | Path, source: str = ENGLISH, target: str = SPANISH, show: bool = True) -> list[VersePair]:
    """Every verse pair of the two Bible modules in the SWORD folder `modules` (the folder holding
    mods.d/), markup stripped; verses empty on either side are dropped."""
    from pysword.modules import SwordModules

    folder = Path(modules)
    if not (folder / "mods.d").is_dir():
        raise FileNotFoundError(f"{folder} holds no mods.d/: not a SWORD module folder (see blockdecode.bible)")
    library = SwordModules(str(folder))
    found = library.parse_modules()
    missing = [name for name in (source, target) if name not in found]
    if missing:
        raise FileNotFoundError(f"{folder} lacks the SWORD module(s) {', '.join(missing)}; it has {sorted(found)}")
    src, tgt = (_open(library, folder, name, found[name]) for name in (source, target))
    pairs = list(_pairs(src, tgt, show))
    counts = Counter(word for p in pairs if not p.ref.endswith(".1") for word in _WORD.findall(p.target))
    return [VersePair(p.ref, p.source, undo_drop_cap(p.target, counts)) if p.ref.endswith(".1") else p for p in pairs]


@dataclass(frozen=True)
class Module:
    """A SWORD module's Bible text as pysword reads it, and the folder its data lies in."""

    name: str
    data: Path
    bible: object

    def verses(self, book: str, chapter: int) -> list[str]:
        """The chapter's verse texts; damaged data is a ValueError naming the module's folder, not
        whatever pysword raises on it."""
        try:
            return list(self.bible.get_iter(books=[book], chapters=[chapter], clean=True))
        except DAMAGED_DATA as err:
            raise ValueError(
                f"{self.data}: the data of the SWORD module {self.name} is damaged ({book} {chapter}: "
                f"{type(err).__name__}: {err})"
            ) from err


def _open(library, folder: Path, name: str, conf: dict[str, str]) -> Module:
    """pysword's reader of module `name`; a .conf without the entries it needs, naming what pysword
    refuses, or data that is missing is an error naming the file."""
    conf_file = _conf_file(folder, name)
    lacking = [key for key in ("DataPath", "ModDrv") if key.lower() not in conf]
    if lacking:
        raise ValueError(f"{conf_file} has no {' or '.join(lacking)} entry for the SWORD module {name}")
    data = folder / conf["datapath"]
    try:
        bible = library.get_bible_from_module(name)
    except OSError as err:  # "Could not open OT or NT for module"
        raise FileNotFoundError(
            f"{data} holds no readable text of the SWORD module {name} (the DataPath of {conf_file})"
        ) from err
    except ValueError as err:  # an unknown ModDrv or versification
        raise ValueError(f"{conf_file}: {err}") from err
    return Module(name, data, bible)


def _conf_file(folder: Path, name: str) -> Path:
    """The .conf in mods.d/ that declares the module `name`."""
    confs = sorted((folder / "mods.d").glob("*.conf"))
    return next((p for p in confs if f"[{name}]" in p.read_text(errors="replace")), folder / "mods.d")


def _pairs(src: Module, tgt: Module, show: bool) -> Iterator[VersePair]:
    books = src.bible.get_structure().get_books()
    chapters = [(book, c) for part in ("ot", "nt") for book in books.get(part, []) for c in range(book.num_chapters)]
    for book, c in tqdm(chapters, desc="reading verse pairs", unit="chapter", disable=not show):
        english, spanish = src.verses(book.name, c + 1), tgt.verses(book.name, c + 1)
        for v, (en, es) in enumerate(zip(english, spanish), start=1):
            en, es = clean(en), clean(es)
            if en and es:
                yield VersePair(f"{book.osis_name}.{c + 1}.{v}", en, es)


def write_corpus(pairs: list[VersePair], out: str | Path) -> dict[str, int]:
    """train.tsv, valid.tsv and test.tsv in `out` (columns: reference, English, Spanish), replacing an
    earlier corpus's as a whole (`io.saving_folder`); the pairs per split."""
    rows: dict[str, list[str]] = {"train": [], **{name: [] for name in SPLITS}}
    for pair in pairs:
        rows[split_of(pair.chapter)].append(f"{pair.ref}\t{pair.source}\t{pair.target}\n")
    with saving_folder(Path(out), "train.tsv") as staging:
        for name in sorted(rows, key=lambda n: n == "train"):  # train.tsv last: it marks the corpus whole
            write_text(staging / f"{name}.tsv", "".join(rows[name]))
    return {name: len(lines) for name, lines in rows.items()}


def read_tsv(path: str | Path) -> list[VersePair]:
    """Pairs from a file `write_corpus` wrote (or any TSV of reference, source, target)."""
    pairs = []
    for n, line in enumerate(read_utf8(path).split("\n"), start=1):
        if not line:
            continue
        fields = line.split("\t")
        if len(fields) != 3:
            raise ValueError(f"{path}:{n}: expected 3 tab-separated fields (reference, source, target)")
        pairs.append(VersePair(*fields))
    return pairs

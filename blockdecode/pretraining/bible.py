"""English-Spanish verse pairs from two public-domain Bibles, the translation corpus.

The King James Bible and the Reina-Valera 1909 share the KJV versification, so verse i of one is
verse i of the other: about 31,000 pairs. Both come as SWORD modules, read with `pysword`. On
Debian or Ubuntu:

    apt-get download sword-text-kjv sword-text-sparv
    for f in sword-text-*.deb; do dpkg-deb -x "$f" sword; done   # modules in sword/usr/share/sword

elsewhere, unzip the modules' zip files from the SWORD project (crosswire.org) into one folder.

The split is by a hash of book and chapter: held-out verses are whole chapters the model never
saw, the same ones on every machine.

Distillation needs English sources only, so other English modules add to them (`read_sources`): the
World English Bible (sword-text-web) is a second English text of the training verses, and the
commentaries of Matthew Henry (sword-comm-mhcc), Scofield (sword-comm-scofield) and Spurgeon
(sword-comm-tdavid) give in-domain English prose, cut into sentences. Both come from training
chapters only."""

from __future__ import annotations

import hashlib
import html
import lzma
import re
import struct
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from blockdecode.core.io import read_utf8, saving_folder, write_text

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
# --extra-sources by short name: the module name each stands for (a pattern: the WEB's carries its year)
EXTRA_SOURCES = {"web": r"engWEB\d*(eb)?", "mhcc": "MHCC", "scofield": "Scofield", "tdavid": "TDavid"}
SENTENCE_WORDS = (8, 60)  # the commentary sentences kept: about a verse's length, up to a long one's
CORPUS_VERSIFICATION = "kjv"  # the corpus's verse numbering, which a second English text must share


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


# OSIS elements whose content is not the text (notes, titles, alternative readings), and inline tags
# (words, emphasis, references, quotes) that stand inside a word's or a sentence's run of characters.
_NOT_TEXT = re.compile(r"<(note|title|rdg|figure)\b[^>]*>.*?</\1>", re.DOTALL)
_INLINE = re.compile(r"</?(?:w|hi|q|seg|reference|transChange|divineName|foreign|name|mentioned|abbr)\b[^>]*>")
_SPACE_BEFORE = re.compile(r"\s+([,.;:!?’”)\]])")


def prose(raw: str) -> str:
    """Plain text of OSIS markup as it is stored (pysword's own cleaning drops a note with no space
    left, gluing "God<note>…</note>created" into one word): notes, titles and alternative readings
    go, inline tags go where they stand, character entities ("&amp;") become their characters,
    other tags a space (`clean`), and no space is left before closing punctuation."""
    return _SPACE_BEFORE.sub(r"\1", clean(html.unescape(_INLINE.sub("", _NOT_TEXT.sub(" ", raw)))))


# A commentary's headings: bold verse labels ("Verses 1-6", "Verse 7.") and the words commented on.
_LABEL = re.compile(r'<hi type="bold">.*?</hi>', re.DOTALL)
_VERSE_NUMBERS = re.compile(r"\((?:v|vv|ver|verses?)?\.?\s*\d[\d\s,:;–-]*\)", re.IGNORECASE)  # "(1-6)", "(ver. 3)"
# not after an abbreviation or an initial ("cf. Matthew", "i.e. The", "O. T.", "St. Paul")
_NOT_AN_END = "".join(
    rf"(?<!\b{a})" for a in (r"[A-Z]\.", r"cf\.", r"i\.e\.", r"e\.g\.", r"viz\.", r"ver\.", r"St\.", r"Mr\.", r"Dr\.")
)
_SENTENCE_END = re.compile(rf"(?:(?<=[.!?])|(?<=[.!?][’”\"')])){_NOT_AN_END}\s+(?=[“‘\"'(]?[A-Z])")
_SENTENCE = re.compile(r"[“‘\"'(]?[A-Z].*[.!?][’”\"')]?")


def sentences(raw: str) -> list[str]:
    """A commentary entry's prose (`prose`, less its headings and verse numbers) cut into sentences:
    at a full stop (not an abbreviation's or an initial's), question or exclamation mark before a
    capital. Pieces that do not start with a capital and end with one of those marks (a list of
    references) are dropped."""
    text = prose(_VERSE_NUMBERS.sub(" ", _LABEL.sub(" ", raw)))
    return [s for s in _SENTENCE_END.split(text) if _SENTENCE.fullmatch(s)]


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
    folder, library, found = _library(modules)
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
    commentary: bool = False  # a commentary's entries are keyed by verse like a Bible's verses

    def verses(self, book: str, chapter: int, clean: bool = True) -> list[str]:
        """The chapter's verse texts (or a commentary's entries, one per verse), cleaned by pysword
        or as they are stored; damaged data is a ValueError naming the module's folder, not
        whatever pysword raises on it."""
        try:
            texts = list(self.bible.get_iter(books=[book], chapters=[chapter], clean=clean))
            if not all(isinstance(text, str) for text in texts):  # uncleaned, RawText's past-the-end bytes pass
                raise TypeError("an index points past the text's end")
            return texts
        except DAMAGED_DATA as err:
            raise ValueError(
                f"{self.data}: the data of the SWORD module {self.name} is damaged ({book} {chapter}: "
                f"{type(err).__name__}: {err})"
            ) from err


def _library(modules: str | Path) -> tuple[Path, object, dict[str, dict[str, str]]]:
    """The SWORD folder `modules`, pysword's library of it and the modules its .conf files declare."""
    from pysword.modules import SwordModules

    folder = Path(modules)
    if not (folder / "mods.d").is_dir():
        raise FileNotFoundError(
            f"{folder} holds no mods.d/: not a SWORD module folder (see blockdecode.pretraining.bible)"
        )
    library = SwordModules(str(folder))
    return folder, library, library.parse_modules()


COMMENTARY_DRIVERS = ("zcom", "zcom4")


def _open(library, folder: Path, name: str, conf: dict[str, str]) -> Module:
    """pysword's reader of module `name`; a .conf without the entries it needs, naming what pysword
    refuses, or data that is missing is an error naming the file."""
    conf_file = _conf_file(folder, name)
    lacking = [key for key in ("DataPath", "ModDrv") if key.lower() not in conf]
    if lacking:
        raise ValueError(f"{conf_file} has no {' or '.join(lacking)} entry for the SWORD module {name}")
    data = folder / conf["datapath"]
    commentary = conf["moddrv"].lower() in COMMENTARY_DRIVERS
    try:
        bible = _commentary(data, conf) if commentary else library.get_bible_from_module(name)
    except OSError as err:  # "Could not open OT or NT for module"
        raise FileNotFoundError(
            f"{data} holds no readable text of the SWORD module {name} (the DataPath of {conf_file})"
        ) from err
    except ValueError as err:  # an unknown ModDrv or versification
        raise ValueError(f"{conf_file}: {err}") from err
    return Module(name, data, bible, commentary)


def _commentary(data: Path, conf: dict[str, str]):
    """pysword's zText reader on a zCom commentary: the two share one layout (an index of block,
    offset and size per verse slot, into compressed blocks), keyed by verse. Its records are 10
    bytes (zCom) or 12 (zCom4); the index's own size says which, as a .conf may not (Debian's MHCC
    declares zCom4 over 10-byte records)."""
    from pysword.bible import SwordBible
    from pysword.books import BibleStructure

    versification = conf.get("versification", "KJV").lower()
    block = conf.get("blocktype", "BOOK").upper()
    compress = conf.get("compresstype", "ZIP").upper()
    if compress not in ("ZIP", "BZIP2", "XZ"):
        raise ValueError(f"CompressType {compress} is not read (ZIP, BZIP2 or XZ)")
    driver = "ztext4" if conf["moddrv"].lower().endswith("4") else "ztext"
    for testament, books in BibleStructure(versification).get_books().items():
        index = data / f"{testament}.{block[0].lower()}zv"
        slots = 2 + sum(book.size for book in books)  # a testament's heading and introduction, then its books'
        if index.is_file() and index.stat().st_size in (10 * slots, 12 * slots):
            driver = "ztext4" if index.stat().st_size == 12 * slots else "ztext"
    return SwordBible(str(data), driver, versification, conf.get("encoding"), conf.get("sourcetype"), block, compress)


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


def open_sources(modules: str | Path, names: Iterable[str]) -> dict[str, Module]:
    """The extra English modules `names` in the SWORD folder `modules`, by the name given: a short
    name of EXTRA_SOURCES or a module's own name. Opened before any verse is read, so a name the
    folder lacks fails at once."""
    folder, library, found = _library(modules)
    opened = {}
    for name in names:
        pattern = EXTRA_SOURCES.get(name.lower(), re.escape(name))
        matches = sorted(m for m in found if re.fullmatch(pattern, m, re.IGNORECASE))
        if not matches:
            raise FileNotFoundError(
                f"{folder} holds no SWORD module {name!r} for the extra sources (short names: "
                f"{', '.join(EXTRA_SOURCES)}, or a module's own name); it has {', '.join(sorted(found))}"
            )
        opened[name] = _open(library, folder, matches[0], found[matches[0]])
    return opened


def read_sources(modules: dict[str, Module], pairs: list[VersePair], show: bool = True) -> dict[str, list[str]]:
    """English distillation sources from each of `modules` (`open_sources`): a Bible's verses of
    the training verses of `pairs` (`second_english`), a commentary's sentences (`commentary`)."""
    return {
        name: commentary(module, show=show)
        if module.commentary
        else [p.source for p in second_english(module, pairs, show)]
        for name, module in modules.items()
    }


def second_english(module: Module, pairs: list[VersePair], show: bool = True) -> list[VersePair]:
    """(the module's English, Spanish) pairs for those of `pairs` in training chapters: a second
    English text of the same Spanish verses, never one of a held-out chapter. Verses are matched by
    reference; a chapter the module numbers otherwise (the NRSVA's 3 John 1 and Revelation 12 have a
    verse more than the KJV's) is left out, its verses not aligned; so are books it lacks."""
    from pysword.books import BibleStructure

    ours = {
        b.osis_name: b.chapter_lengths
        for part in BibleStructure(CORPUS_VERSIFICATION).get_books().values()
        for b in part
    }
    theirs = {b.osis_name: b for part in module.bible.get_structure().get_books().values() for b in part}
    chapters: dict[str, list[VersePair]] = defaultdict(list)
    for pair in pairs:
        if split_of(pair.chapter) == "train":
            chapters[pair.chapter].append(pair)
    found = []
    for chapter, verses in tqdm(chapters.items(), desc=f"reading {module.name}", unit="chapter", disable=not show):
        book, c = chapter.rsplit(".", 1)
        c = int(c)
        if book not in theirs or theirs[book].chapter_lengths[c - 1 : c] != ours.get(book, [])[c - 1 : c]:
            continue
        texts = module.verses(theirs[book].name, c, clean=False)
        for pair in verses:
            english = prose(texts[int(pair.ref.rsplit(".", 1)[1]) - 1])
            if english:
                found.append(VersePair(pair.ref, english, pair.target))
    return found


def commentary(module: Module, words: tuple[int, int] = SENTENCE_WORDS, show: bool = True) -> list[str]:
    """The sentences of a commentary's entries on training chapters, each once, in order, of
    `words` words (inclusive bounds). An entry stands under every verse it comments on (SWORD links
    a verse range to one text), so one that also stands under a held-out chapter is left out whole;
    book and chapter introductions (slots between the verses) are not read."""
    structure = module.bible.get_structure().get_books()
    chapters = [
        (book, c) for part in ("ot", "nt") for book in structure.get(part, []) for c in range(1, book.num_chapters + 1)
    ]
    training, held_out = {}, set()  # entries, the first in order
    for book, c in tqdm(chapters, desc=f"reading {module.name}", unit="chapter", disable=not show):
        entries = training if split_of(f"{book.osis_name}.{c}") == "train" else held_out
        entries.update(dict.fromkeys(e for e in module.verses(book.name, c, clean=False) if e.strip()))
    found = (s for entry in training if entry not in held_out for s in sentences(entry))
    return list(dict.fromkeys(s for s in found if words[0] <= len(s.split()) <= words[1]))


def write_corpus(
    pairs: list[VersePair], out: str | Path, sources: dict[str, list[str]] | None = None
) -> dict[str, int]:
    """train.tsv, valid.tsv and test.tsv in `out` (columns: reference, English, Spanish), and
    sources-NAME.txt for each of `sources` (one English source a line), replacing an earlier
    corpus's files as a whole (`io.saving_folder`), its sources files too; the pairs per split."""
    rows: dict[str, list[str]] = {"train": [], **{name: [] for name in SPLITS}}
    for pair in pairs:
        rows[split_of(pair.chapter)].append(f"{pair.ref}\t{pair.source}\t{pair.target}\n")
    earlier = [p.name for p in Path(out).glob("sources-*.txt")]
    with saving_folder(Path(out), "train.tsv", replaces=earlier) as staging:
        for name, lines in (sources or {}).items():
            write_text(staging / sources_file(name), "".join(f"{line}\n" for line in lines))
        for name in sorted(rows, key=lambda n: n == "train"):  # train.tsv last: it marks the corpus whole
            write_text(staging / f"{name}.tsv", "".join(rows[name]))
    return {name: len(lines) for name, lines in rows.items()}


def sources_file(name: str) -> str:
    return f"sources-{name.lower()}.txt"


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

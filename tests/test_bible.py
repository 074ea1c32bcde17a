"""The translation corpus: verse pairs read from SWORD modules with pysword, cleaned, and split by
chapter, and the extra English sources for distillation. The modules are written here in SWORD's
RawText format (an index of offset and length per verse slot of the KJV versification) and its zText
and zCom format (an index of block, offset and length per slot into compressed blocks), so the real
reader runs on them."""

from __future__ import annotations

import random
import re
import shutil
import struct
import zlib
from collections import Counter
from pathlib import Path

import pytest
from conftest import interrupt_after
from pysword.books import BibleStructure

from blockdecode.cli import main
from blockdecode.pretraining.bible import (
    ENGLISH,
    SPANISH,
    VersePair,
    clean,
    commentary,
    open_sources,
    read_pairs,
    read_sources,
    read_tsv,
    second_english,
    sentences,
    split_of,
    undo_drop_cap,
    write_corpus,
)

VERSES = {
    ("Genesis", 1, 1): (
        'In the <w lemma="strong:H7225">beginning</w> God created the heaven and the earth.',
        '<w lemma="strong:H7225">EN el principio</w> crió Dios los cielos y la tierra.',
    ),
    ("Genesis", 1, 2): ("\u00b6 And the earth was without form,  and void.", "Y la tierra estaba desordenada y vacía."),
    ("Genesis", 1, 3): ("And God said, Let there be light.", ""),  # empty on one side: dropped
    ("Genesis", 1, 4): ("And God saw the light, that it was good.", '<milestone type="x"/> \u00b6'),  # markup only
    ("Genesis", 2, 1): ("Thus the heavens and the earth were finished.", "Y FUERON acabados los cielos y la tierra."),
    ("Matthew", 1, 1): ("The book of the generation of Jesus Christ.", "LIBRO de la generación de Jesucristo."),
}  # fmt: skip


def write_module(library: Path, name: str, side: int, verses: dict = VERSES) -> None:
    """A RawText SWORD module holding side `side` (0 English, 1 Spanish) of `verses`."""
    data = library / "modules" / "texts" / "rawtext" / name.lower()
    data.mkdir(parents=True)
    structure = BibleStructure("kjv")
    for testament in ("ot", "nt"):
        slots = {}
        for (book, chapter, verse), texts in verses.items():
            found = structure.ref_to_indicies(books=[book], chapters=[chapter], verses=[verse]).get(testament)
            if found:
                slots[found[0]] = f'{texts[side]}<note type="x">a note</note>'.encode() if texts[side] else b""
        index, text = bytearray(6 * (max(slots) + 2)), bytearray()
        for slot, body in slots.items():
            struct.pack_into("<IH", index, 6 * slot, len(text), len(body))
            text += body
        (data / f"{testament}.vss").write_bytes(bytes(index))
        (data / testament).write_bytes(bytes(text))
    (library / "mods.d").mkdir(exist_ok=True)
    (library / "mods.d" / f"{name.lower()}.conf").write_text(
        f"[{name}]\nDataPath=./modules/texts/rawtext/{name.lower()}/\nModDrv=RawText\nSourceType=OSIS\n"
        "Encoding=UTF-8\nVersification=KJV\n"
    )


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sword")
    write_module(folder, ENGLISH, 0)
    write_module(folder, SPANISH, 1)
    return folder


def test_pairs_are_aligned_cleaned_and_empty_verses_dropped(library: Path) -> None:
    pairs = read_pairs(library, show=False)
    assert [p.ref for p in pairs] == ["Gen.1.1", "Gen.1.2", "Gen.2.1", "Matt.1.1"]
    assert pairs[0] == VersePair(
        "Gen.1.1",
        "In the beginning God created the heaven and the earth.",
        "En el principio crió Dios los cielos y la tierra.",
    )  # the word tags and the note gone
    assert pairs[1].source == "And the earth was without form, and void."  # the paragraph mark and double space gone
    assert pairs[2].target.startswith("Y fueron")  # both capitalised words of the run undone
    assert pairs[3].target.startswith("Libro de la")


def test_the_split_is_by_chapter_and_stable() -> None:
    assert split_of("Gen.1") == split_of("Gen.1")
    chapters = [f"{book}.{c}" for book in ("Gen", "Exod", "Ps", "Isa", "Matt", "Rev") for c in range(1, 60)]
    splits = [split_of(c) for c in chapters]
    assert {"train", "valid", "test"} == set(splits)
    assert 0.85 < splits.count("train") / len(splits) < 0.99


def test_corpus_files_round_trip_and_hold_whole_chapters(tmp_path: Path, library: Path) -> None:
    pairs = [
        VersePair(f"Ps.{c}.{v}", f"verse {v} of {c}", f"versículo {v} de {c}") for c in range(1, 151) for v in (1, 2)
    ]
    counts = write_corpus(pairs, tmp_path)
    assert sum(counts.values()) == len(pairs) and counts["valid"] and counts["test"]
    back = {name: read_tsv(tmp_path / f"{name}.tsv") for name in counts}
    assert sorted((p for ps in back.values() for p in ps), key=pairs.index) == pairs
    for name, split in back.items():
        assert all(split_of(p.chapter) == name for p in split)


def test_clean_and_drop_caps() -> None:
    assert clean("  a \u00b6 b\n c ") == "a b c"
    counts = Counter({"en": 9, "En": 2, "fueron": 4, "Jehová": 7, "habló": 3, "Habló": 1})
    assert undo_drop_cap("EN el principio", counts) == "En el principio"
    assert undo_drop_cap("Y FUERON acabados", counts) == "Y fueron acabados"
    assert undo_drop_cap("Y JEHOVÁ habló", counts) == "Y Jehová habló"
    assert undo_drop_cap("Y HABLÓ Jehová, el REY", counts) == "Y habló Jehová, el REY"  # the run ends at "Jehová"
    assert undo_drop_cap("LIBRO, de la", counts) == "Libro, de la"


def test_a_folder_that_is_not_a_sword_library_is_named(tmp_path: Path, library: Path) -> None:
    with pytest.raises(FileNotFoundError, match="holds no mods.d"):
        read_pairs(tmp_path)
    with pytest.raises(FileNotFoundError, match="lacks the SWORD module"):
        read_pairs(library, target="gerLut1912", show=False)
    (tmp_path / "bad.tsv").write_text("Gen.1.1\tonly two\n")
    with pytest.raises(ValueError, match="bad.tsv:1: expected 3 tab-separated fields"):
        read_tsv(tmp_path / "bad.tsv")


def test_cli_writes_the_corpus(library: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    main(["bible", "--modules", str(library), "--out", str(tmp_path / "bible")])
    assert sum(len(read_tsv(tmp_path / "bible" / f"{s}.tsv")) for s in ("train", "valid", "test")) == 4
    assert "4 verse pairs" in capsys.readouterr().out


def test_an_out_that_cannot_be_written_is_refused_before_reading(library: Path, tmp_path: Path, monkeypatch) -> None:
    from blockdecode.pretraining import bible

    def read(*args, **kwargs):
        raise AssertionError("the modules were read")

    monkeypatch.setattr(bible, "read_pairs", read)
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match=f"^error: --out {tmp_path / 'file'} cannot be written"):
        main(["bible", "--modules", str(library), "--out", str(tmp_path / "file")])


@pytest.mark.parametrize("damage", ["random index", "truncated text", "no DataPath", "no data"])
def test_a_damaged_module_is_one_line_naming_its_file(tmp_path: Path, damage: str) -> None:
    """Whatever pysword raises on bad module data (or a KeyError for a .conf it cannot use) becomes
    one line naming the file or folder at fault."""
    write_module(tmp_path, ENGLISH, 0)
    write_module(tmp_path, SPANISH, 1)
    data = tmp_path / "modules" / "texts" / "rawtext" / SPANISH.lower()
    conf = tmp_path / "mods.d" / f"{SPANISH.lower()}.conf"
    expected = f"{data}: the data of the SWORD module {SPANISH} is damaged (Genesis 1: "
    if damage == "random index":
        index = data / "ot.vss"
        index.write_bytes(random.Random(0).randbytes(index.stat().st_size))
    elif damage == "truncated text":
        (data / "ot").write_bytes((data / "ot").read_bytes()[:20])
    elif damage == "no DataPath":
        conf.write_text("".join(line for line in conf.read_text().splitlines(True) if not line.startswith("DataPath")))
        expected = f"{conf} has no DataPath entry for the SWORD module {SPANISH}"
    else:
        shutil.rmtree(data)
        expected = f"{data} holds no readable text of the SWORD module {SPANISH} (the DataPath of {conf})"
    with pytest.raises(SystemExit, match=f"^error: {re.escape(expected)}[^\n]*$"):
        main(["bible", "--modules", str(tmp_path), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_an_interrupted_corpus_leaves_the_old_files_or_the_new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped after any split's file is written, a new corpus leaves the earlier one as it was."""

    def pairs(text: str) -> list[VersePair]:
        return [VersePair(f"Ps.{c}.1", f"{text} {c}", f"{text} {c}") for c in range(1, 151)]

    write_corpus(pairs("old"), tmp_path)
    old = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for stop in range(1, len(old) + 1):
        interrupt_after(monkeypatch, stop)
        with pytest.raises(KeyboardInterrupt):
            write_corpus(pairs("new"), tmp_path)
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == old, f"stopped after {stop} files"
    monkeypatch.undo()
    write_corpus(pairs("new"), tmp_path)
    assert all("old" not in p.read_text() for p in tmp_path.iterdir())


# ----------------------------------------------------------------------------- extra English sources

EXTRA_VERSES = {  # KJV, RV, WEB (as stored, markup and all)
    ("Gen", 1, 1): (
        "In the beginning God created the heaven and the earth.",
        "En el principio crió Dios los cielos y la tierra.",
        'In the beginning, <w lemma="strong:H0430">God</w><note type="x">Elohim.</note><w>created</w> the heavens '
        "and the earth.",
    ),
    ("Gen", 1, 2): ("And the earth was void.", "Y la tierra estaba vacía.", "The earth was empty<note>Or void</note>."),
    ("Gen", 1, 3): ("And God said, Let there be light.", "", "God said, “Let there be light.”"),  # no Spanish: no pair
    ("Gen", 1, 4): ("And God saw the light.", "Y vió Dios que la luz era buena.", ""),  # not in the WEB
    ("Gen", 28, 1): ("And Isaac called Jacob.", "Y Isaac llamó á Jacob.", "Isaac called Jacob."),  # a held-out chapter
    ("Rev", 12, 17): ("And the dragon was wroth.", "Entonces el dragón fué airado.", "The dragon grew angry."),
    ("Matt", 1, 1): ("The book of Jesus Christ.", "Libro de Jesucristo.", "The book of the genealogy of Jesus Christ."),
}  # fmt: skip
LONG = "This sentence is far too long to keep, " + "and it goes on " * 15 + "until it ends."
NOTES = {  # a commentary: entries keyed by verse, one under several verses where SWORD links them
    ("Gen", 1, 1): '<div type="x-milestone" subType="x-preverse" sID="pv1"/><title type="x-s2">Chapter 1</title> '
    "<table><row><cell>God creates the heaven and the earth on the first day.</cell><cell>(1-2)</cell></row></table> "
    '<hi type="bold">Verses 1-2</hi> <div sID="gen1" type="x-p"/>The first verse of the Bible gives us a sure account '
    "of the beginning of the world (ver. 1). Moses wrote it down &amp; Israel kept it<note type=\"x\">A note, not the "
    f"commentary's own prose at all.</note> for the ages to come. Short, too short. {LONG} <div eID=\"gen1\"/>",
    ("Gen", 1, 2): "linked",
    ("Gen", 27, 46): "Rebekah was weary of her life because of the daughters of Heth, and said so to Isaac.",
    ("Gen", 28, 1): "linked",  # the entry above stands under a held-out chapter too: left out whole
    ("Gen", 28, 5): "Jacob went to Padan-aram, and the story of this chapter is held out from training.",
    ("Matt", 1, 1): '<hi type="bold">in the spirit</hi> of the law, and not of its letter, as the apostle says to the '
    "Romans. This gospel opens with the genealogy of our Lord, from Abraham down to Joseph the husband of Mary. The "
    "first verse of the Bible gives us a sure account of the beginning of the world.",
}  # fmt: skip
NOTE_SENTENCES = [
    "God creates the heaven and the earth on the first day.",
    "The first verse of the Bible gives us a sure account of the beginning of the world.",
    "Moses wrote it down & Israel kept it for the ages to come.",
    "This gospel opens with the genealogy of our Lord, from Abraham down to Joseph the husband of Mary.",
]


def write_zverse(
    library: Path, name: str, entries: dict[tuple, str], moddrv: str, record: int, versification: str, block: str
) -> Path:
    """A zText or zCom SWORD module of `entries` (verse slot -> stored text): per testament one zlib
    block, and an index of (block, offset, length) records of `record` bytes (10, or 12 for the
    zText4/zCom4 kind) for every slot of `versification`. An entry "linked" repeats the one before."""
    kind = "comments" if "Com" in moddrv else "texts"
    data = library / "modules" / kind / moddrv.lower() / name.lower()
    data.mkdir(parents=True)
    structure, letter = BibleStructure(versification.lower()), block[0].lower()
    texts = list(entries.values())
    texts = [texts[i - 1] if text == "linked" else text for i, text in enumerate(texts)]
    for testament, books in structure.get_books().items():
        slots = [b""] * (2 + sum(book.size for book in books))
        for (book, chapter, verse), text in zip(entries, texts):
            found = structure.ref_to_indicies(books=[book], chapters=[chapter], verses=[verse]).get(testament)
            if found:
                slots[found[0]] = text.encode()
        body, index = bytearray(), bytearray()
        for text in slots:
            index += struct.pack("<III" if record == 12 else "<IIH", 0, len(body), len(text))
            body += text
        compressed = zlib.compress(bytes(body))
        (data / f"{testament}.{letter}zv").write_bytes(bytes(index))
        (data / f"{testament}.{letter}zs").write_bytes(struct.pack("<III", 0, len(compressed), len(body)))
        (data / f"{testament}.{letter}zz").write_bytes(compressed)
    conf = library / "mods.d" / f"{name.lower()}.conf"
    conf.write_text(
        f"[{name}]\nDataPath=./modules/{kind}/{moddrv.lower()}/{name.lower()}/\nModDrv={moddrv}\nSourceType=OSIS\n"
        f"Encoding=UTF-8\nBlockType={block}\nCompressType=ZIP\nVersification={versification}\n"
    )
    return conf


def write_extra_library(folder: Path) -> Path:
    """The corpus's two Bibles, a WEB numbered as the NRSVA with a book the KJV lacks, MHCC's kind of
    commentary (declared zCom4 over 10-byte records, as Debian's is) and Treasury of David's (zCom4)."""
    write_module(folder, ENGLISH, 0, EXTRA_VERSES)
    write_module(folder, SPANISH, 1, EXTRA_VERSES)
    web = {verse: texts[2] for verse, texts in EXTRA_VERSES.items()} | {("Tob", 1, 1): "These are the words of Tobit."}
    write_zverse(folder, "engWEB2015eb", web, "zText", 10, "NRSVA", "BOOK")
    write_zverse(folder, "MHCC", NOTES, "zCom4", 10, "KJV", "BOOK")
    psalms = {("Ps", 2, 1): "The second Psalm asks why the nations rage against the Lord and his anointed."}
    psalms[("Ps", 1, 1)] = "The first Psalm is held out from training and nothing of it may be read."
    write_zverse(folder, "TDavid", psalms, "zCom4", 12, "KJV", "CHAPTER")
    return folder


@pytest.fixture(scope="module")
def extra_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_extra_library(tmp_path_factory.mktemp("sword-extra"))


def test_the_web_adds_english_of_training_verses_only(extra_library: Path) -> None:
    """Matched by reference to the corpus's pairs of training chapters, its markup gone without
    gluing words at a note; a held-out chapter, a chapter numbered otherwise and a book the KJV
    lacks add nothing."""
    pairs = read_pairs(extra_library, show=False)
    spanish = {p.ref: p.target for p in pairs}
    assert set(spanish) == {"Gen.1.1", "Gen.1.2", "Gen.1.4", "Gen.28.1", "Matt.1.1", "Rev.12.17"}
    web = second_english(open_sources(extra_library, ["web"])["web"], pairs, show=False)
    assert web == [
        VersePair("Gen.1.1", "In the beginning, God created the heavens and the earth.", spanish["Gen.1.1"]),
        VersePair("Gen.1.2", "The earth was empty.", spanish["Gen.1.2"]),
        VersePair("Matt.1.1", "The book of the genealogy of Jesus Christ.", spanish["Matt.1.1"]),
    ]  # Gen.1.4: empty in the WEB; Gen.28: held out; Rev.12: the NRSVA numbers it otherwise
    assert all(split_of(p.chapter) == "train" for p in web) and split_of("Gen.28") != "train"


def test_commentary_gives_bounded_sentences_of_training_chapters(extra_library: Path) -> None:
    modules = open_sources(extra_library, ["mhcc", "tdavid"])
    assert commentary(modules["mhcc"], show=False) == NOTE_SENTENCES
    assert commentary(modules["tdavid"], show=False) == [
        "The second Psalm asks why the nations rage against the Lord and his anointed."
    ]  # Psalm 1 is a held-out chapter
    assert commentary(modules["mhcc"], words=(8, 13), show=False) == [NOTE_SENTENCES[0], NOTE_SENTENCES[2]]
    everything = sentences(NOTES[("Gen", 1, 1)])
    assert LONG in everything and "Short, too short." in everything  # kept by sentences(), cut by commentary()
    assert not any(re.search(r"[<>]|&amp;|Chapter 1|Verses|\(|note", s) for s in everything)


def test_extra_sources_by_short_or_module_name_and_unknown_ones_named(extra_library: Path) -> None:
    modules = open_sources(extra_library, ["web", "engWEB2015eb", "MHCC"])
    assert [m.name for m in modules.values()] == ["engWEB2015eb", "engWEB2015eb", "MHCC"]
    assert [m.commentary for m in modules.values()] == [False, False, True]
    with pytest.raises(FileNotFoundError, match=r"holds no SWORD module 'scofield' .* it has .*MHCC"):
        open_sources(extra_library, ["web", "scofield"])
    pairs = read_pairs(extra_library, show=False)
    assert read_sources(modules, pairs, show=False)["MHCC"] == NOTE_SENTENCES


def test_cli_writes_the_extra_sources_and_drops_them_when_not_asked(
    extra_library: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "bible"
    main(["bible", "--modules", str(extra_library), "--out", str(out), "--extra-sources", "web,MHCC,tdavid"])
    assert (out / "sources-web.txt").read_text(encoding="utf-8").splitlines()[0].startswith("In the beginning, God")
    assert (out / "sources-mhcc.txt").read_text(encoding="utf-8") == "".join(f"{s}\n" for s in NOTE_SENTENCES)
    assert len((out / "sources-tdavid.txt").read_text().splitlines()) == 1
    printed = capsys.readouterr().out
    assert "3 English verses on training chapters from engWEB2015eb in sources-web.txt" in printed
    assert "4 sentences of commentary on training chapters from MHCC in sources-mhcc.txt" in printed
    main(["bible", "--modules", str(extra_library), "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["test.tsv", "train.tsv", "valid.tsv"]
    with pytest.raises(SystemExit, match="^error: .* holds no SWORD module 'asv'"):
        main(["bible", "--modules", str(extra_library), "--out", str(tmp_path / "new"), "--extra-sources", "web,asv"])
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("damage", ["no data", "LZSS"])
def test_a_commentary_that_cannot_be_read_is_one_line_naming_its_file(tmp_path: Path, damage: str) -> None:
    write_extra_library(tmp_path)
    data = tmp_path / "modules" / "comments" / "zcom4" / "mhcc"
    conf = tmp_path / "mods.d" / "mhcc.conf"
    if damage == "no data":
        shutil.rmtree(data)
        expected = f"{data} holds no readable text of the SWORD module MHCC (the DataPath of {conf})"
    else:
        conf.write_text(conf.read_text().replace("CompressType=ZIP", "CompressType=LZSS"))
        expected = f"{conf}: CompressType LZSS is not read"
    with pytest.raises(SystemExit, match=f"^error: {re.escape(expected)}[^\n]*$"):
        main(["bible", "--modules", str(tmp_path), "--out", str(tmp_path / "out"), "--extra-sources", "mhcc"])
    assert not (tmp_path / "out").exists()

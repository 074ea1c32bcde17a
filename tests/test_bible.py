"""The translation corpus: verse pairs read from SWORD modules with pysword, cleaned, and split by
chapter. The modules are written here in SWORD's RawText format (an index of offset and length per
verse slot of the KJV versification), so the real reader runs on them."""

from __future__ import annotations

import random
import re
import shutil
import struct
from collections import Counter
from pathlib import Path

import pytest
from conftest import interrupt_after
from pysword.books import BibleStructure

from blockdecode.bible import (
    ENGLISH,
    SPANISH,
    VersePair,
    clean,
    read_pairs,
    read_tsv,
    split_of,
    undo_drop_cap,
    write_corpus,
)
from blockdecode.cli import main

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


def write_module(library: Path, name: str, side: int) -> None:
    """A RawText SWORD module holding side `side` (0 English, 1 Spanish) of VERSES."""
    data = library / "modules" / "texts" / "rawtext" / name.lower()
    data.mkdir(parents=True)
    structure = BibleStructure("kjv")
    for testament in ("ot", "nt"):
        slots = {}
        for (book, chapter, verse), texts in VERSES.items():
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

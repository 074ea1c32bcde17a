"""A GGUF file as a plain model folder: dequantized once through transformers' GGUF reader into blockdecode's cache,
keyed by the file's content and checked by the hashes written when it was made, as the corpus cache is."""

from __future__ import annotations

import atexit
import math
import mmap
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedModel,
)

from blockdecode.core.hf import dtype_name
from blockdecode.core.io import (
    CheckpointError,
    cache_root,
    file_digest,
    file_stamp,
    locked,
    one_line,
    read_json,
    reading_folder,
    saving_folder,
    write_json,
)

GGUF_MAGIC = b"GGUF"
GGUF_SOURCE = "source.json"  # written last into a conversion: the content it was made from, each file's size and hash
GGUF_CHECKED = "checked.json"  # beside it: each file's stamp when its hash was last found right
GGUF_INDEX = "index.json"  # in the cache: each GGUF file's stamp when it was hashed, and its content's sha256
GGUF_CONVERSION = re.compile(r"[0-9a-f]{16}-[a-z0-9]+")  # a conversion's folder: its content's key, its dtype
_UNCACHED: dict[tuple, Path] = {}  # a file's path, stamp and dtype -> its conversion in a temporary folder


def magic(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def gguf_folder(file: Path, dtype: torch.dtype | None = None) -> Path:
    """The plain model folder a GGUF file is dequantized into once, through transformers' GGUF reader, in `dtype`
    (None: whichever was made before, else fp32). It is cached by the file's content (`_content_key`): a copy at
    another path, a rename or a `touch` reuse it, and a file whose content changed replaces its conversion. Each
    conversion's source.json holds every file's size and sha256, checked before it is read (`_damage`): a damaged
    one is made again, said in one line. A cache location that cannot be used is found before converting: the
    model then goes into a temporary folder, uncached, with a note.

    What is hashed when: the GGUF file when its stamp (`file_stamp`: inode, size, mtime, ctime) is not the one
    indexed with it, a conversion's files when theirs is not the one recorded in its checked.json after their
    hash was last found right; a load that finds every stamp as recorded reads no file whole. Any write moves
    ctime, even one that puts mtime back, so an edit is always caught. The trade-off: bytes that change with no
    write (a failing disk) go unseen until a stamp moves, where hashing a 2 GB folder on every load costs seconds."""
    file = file.resolve()
    if magic(file) != GGUF_MAGIC:
        raise CheckpointError(f"{file} is not a GGUF file (it does not begin with the bytes GGUF)")
    choices = [dtype] if dtype is not None else [torch.float32, torch.bfloat16]
    cache = cache_root() / "gguf"
    unusable = _unusable(cache)
    if unusable:
        memo = (str(file), *file_stamp(file), dtype_name(choices[0]))
        if memo not in _UNCACHED or not (_UNCACHED[memo] / GGUF_SOURCE).is_file():
            print(
                f"blockdecode: the GGUF conversion cache {cache} cannot be used ({unusable}); converting {file} "
                "into a temporary folder, going on uncached",
                file=sys.stderr,
                flush=True,
            )
            _UNCACHED[memo] = _dequantize(file, None, choices[0], file_digest(file))
        return _UNCACHED[memo]
    key = _content_key(file, cache)
    for choice in choices:
        folder = cache / f"{key[:16]}-{dtype_name(choice)}"
        if _made(folder):
            why = _damage(folder, key, choice)
            if not why:
                return folder
            print(
                f"blockdecode: {folder} (blockdecode's own conversion cache, safe to delete) is damaged: {why}; "
                "making it again",
                file=sys.stderr,
                flush=True,
            )
            return _dequantize(file, folder, choice, key)
    return _dequantize(file, cache / f"{key[:16]}-{dtype_name(choices[0])}", choices[0], key)


def _unusable(cache: Path) -> str:
    """Why `cache` cannot take a conversion ("" where it can), found by making it and a file in it before minutes
    of converting: a file in its place or in place of a folder above it, or no permission to write."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=cache, prefix=".probe-", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        blocker = next((p for p in (cache, *cache.parents) if p.exists() and not p.is_dir()), None)
        return f"{blocker} is a file, not a folder" if blocker else (err.strerror or one_line(err))
    return ""


def _content_key(file: Path, cache: Path) -> str:
    """The sha256 of `file`'s content: as indexed where its stamp is the one indexed with it, else hashed and
    indexed. Indexing a path whose content changed removes the conversions of its old content, unless another
    indexed file holds that; paths that no longer exist leave the index, and the conversions only they held go
    with them (as do folders of an older naming, never read again)."""
    stamp = file_stamp(file)
    entry = _read_index(cache).get(str(file))
    if entry is not None and entry["stamp"] == stamp:
        return entry["sha256"]
    key = file_digest(file)
    with locked(cache):
        before = _read_index(cache)
        index = {path: e for path, e in before.items() if path != str(file) and Path(path).is_file()}
        index[str(file)] = {"stamp": stamp, "sha256": key}
        gone = {e["sha256"][:16] for e in before.values()} - {e["sha256"][:16] for e in index.values()}
        for folder in cache.iterdir():
            if folder.is_dir() and (folder.name[:16] in gone or not GGUF_CONVERSION.fullmatch(folder.name)):
                with locked(folder):  # after any reader that is checking it
                    shutil.rmtree(folder, ignore_errors=True)
        try:
            write_json(cache / GGUF_INDEX, index)
        except OSError:  # the next load hashes the file again
            pass
    return key


def _read_index(cache: Path) -> dict[str, dict]:
    """The cache's index, its well-formed entries only: a damaged one costs hashing again, nothing else."""
    try:
        index = read_json(cache / GGUF_INDEX) if (cache / GGUF_INDEX).is_file() else {}
    except ValueError:
        return {}
    if not isinstance(index, dict):
        return {}
    return {
        path: e
        for path, e in index.items()
        if isinstance(e, dict) and isinstance(e.get("stamp"), list) and isinstance(e.get("sha256"), str)
    }


def _made(folder: Path) -> bool:
    """Whether a conversion was made into `folder`, whole or not (one killed before its swap leaves only hidden
    staging behind, which the next save clears)."""
    return folder.exists() and (not folder.is_dir() or any(not p.name.startswith(".") for p in folder.iterdir()))


def _damage(folder: Path, key: str, dtype: torch.dtype) -> str:
    """What is wrong with `folder` as the `dtype` conversion of the content `key` names, "" where nothing is: its
    source.json must describe that, and every file it lists must be there with the size and sha256 written. A file
    is hashed only where its stamp is not the one recorded in checked.json when its hash was last found right."""
    if not folder.is_dir():
        return "it is a file, not a folder"
    with reading_folder(folder, GGUF_SOURCE):
        if not (folder / GGUF_SOURCE).is_file():
            return f"its {GGUF_SOURCE} is missing"
        try:
            made = read_json(folder / GGUF_SOURCE)
        except ValueError:
            return f"its {GGUF_SOURCE} is not valid JSON"
        files = made.get("files") if isinstance(made, dict) else None
        if (
            not isinstance(files, dict)
            or not files
            or (made.get("sha256"), made.get("dtype")) != (key, dtype_name(dtype))
            or not all(isinstance(f, dict) and {"size", "sha256"} <= f.keys() for f in files.values())
        ):
            return f"its {GGUF_SOURCE} does not describe a {dtype_name(dtype)} conversion of this file"
        checked = _read_checked(folder)
        found = {}
        for name, written in files.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            try:
                stamp = file_stamp(path)
                if stamp[1] != written["size"]:
                    return f"{name} holds {stamp[1]} bytes, not the {written['size']} written"
                if checked.get(name) != [*stamp, written["sha256"]] and file_digest(path) != written["sha256"]:
                    return f"{name} does not match the sha256 written when it was made"
            except OSError as err:
                return f"{name} cannot be read ({err.strerror or one_line(err)})"
            found[name] = [*stamp, written["sha256"]]
        if found != checked:
            _record_checked(folder, found)
    return ""


def _read_checked(folder: Path) -> dict:
    try:
        checked = read_json(folder / GGUF_CHECKED) if (folder / GGUF_CHECKED).is_file() else {}
    except ValueError:
        return {}
    return checked if isinstance(checked, dict) else {}


def _record_checked(folder: Path, checked: dict) -> None:
    try:
        write_json(folder / GGUF_CHECKED, checked)
    except OSError:  # unrecorded, the files are hashed again on the next load
        pass


def _dequantize(file: Path, folder: Path | None, dtype: torch.dtype, key: str) -> Path:
    """Read `file` through transformers' GGUF reader and save it as a plain folder, written whole or not at all:
    `folder` in the cache, or a temporary folder removed at exit where `folder` is None or cannot be written (a full
    disk). A file cut short is said so first, with the architecture its header names."""
    size = file.stat().st_size
    cut = _cut_short(file, size)
    if cut:
        raise CheckpointError(cut)
    into = f"once into {folder}" if folder is not None else "into a temporary folder"
    print(
        f"blockdecode: dequantizing {file} ({size / 1e6:.0f} MB) {into} ({dtype_name(dtype)})",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    where = {"pretrained_model_name_or_path": str(file.parent), "gguf_file": file.name}
    try:
        config = AutoConfig.from_pretrained(**where)
        auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
        model = auto.from_pretrained(**where, dtype=dtype, quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(**where)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # the gguf reader and transformers' mappings raise what they like
        architecture = _gguf_header(file).architecture or "not named in its header"
        raise CheckpointError(
            f"{file}: transformers cannot read this GGUF (architecture {architecture}): {one_line(err)}"
        ) from err
    model.hf_quantizer = None  # its weights are plain tensors now: saved as such
    model.config.__dict__.pop("quantization_config", None)
    source = {"sha256": key, "gguf": str(file), "size": size, "dtype": dtype_name(dtype)}
    if folder is not None:
        try:
            _save(model, tokenizer, folder, source)
        except OSError as err:
            print(
                f"blockdecode: {folder} cannot be written ({err.strerror or one_line(err)}); going on uncached",
                file=sys.stderr,
                flush=True,
            )
            folder = None
    if folder is None:
        try:
            folder = _temporary() / f"{key[:16]}-{dtype_name(dtype)}"
            _save(model, tokenizer, folder, source)
        except OSError as err:
            raise CheckpointError(
                f"{file}: its conversion can be written neither into the cache nor into a temporary folder "
                f"({err.strerror or one_line(err)})"
            ) from err
    print(f"blockdecode: {folder.name} made in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return folder


def _save(model: PreTrainedModel, tokenizer, folder: Path, source: dict) -> None:
    """The conversion saved into `folder` in place of whatever was there, source.json last with each file's size
    and sha256, then their stamps recorded as checked."""
    if folder.is_file():
        folder.unlink()
    with saving_folder(folder, GGUF_SOURCE, whole=True) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        files = {p.name: {"size": p.stat().st_size, "sha256": file_digest(p)} for p in staging.iterdir() if p.is_file()}
        write_json(staging / GGUF_SOURCE, {**source, "files": files})
    _record_checked(folder, {name: [*file_stamp(folder / name), f["sha256"]] for name, f in files.items()})


def _temporary() -> Path:
    """A folder of its own under the system's temporary folder, removed when this process exits."""
    folder = Path(tempfile.mkdtemp(prefix="blockdecode-gguf-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


class GgufHeader(NamedTuple):
    architecture: str | None  # general.architecture, where the header gets that far
    needs: int | None  # bytes the file must hold: its header, padding, every tensor's data; None where unknown
    cut: bool  # the header itself runs past the end of the file


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_header(file: Path) -> GgufHeader:
    """What a GGUF file's header says, read from the header alone, so that a file cut short still names its
    architecture and the bytes its tensors need (gguf's own reader maps every tensor first, and fails on the
    first one cut short)."""
    from gguf.constants import GGML_QUANT_SIZES

    found: dict[str, object] = {}
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        raw = m[4:8]
        order = "<" if int.from_bytes(raw, "little") & 0xFFFF else ">"  # a big-endian file's version reads swapped

        def take(fmt: str) -> tuple:
            return struct.unpack(order + fmt, m.read(struct.calcsize(order + fmt)))  # struct.error past the end

        def text() -> str:
            (n,) = take("Q")
            data = m.read(n)
            if len(data) < n:
                raise struct.error("past the end")
            return data.decode("utf-8", "replace")

        def value(kind: int) -> object:
            if kind == _GGUF_STRING:
                return text()
            if kind == _GGUF_ARRAY:
                item, n = take("IQ")
                if item in _GGUF_SCALARS:
                    m.seek(n * struct.calcsize(order + _GGUF_SCALARS[item]), os.SEEK_CUR)  # ValueError past the end
                else:
                    for _ in range(n):
                        value(item)
                return None
            return take(_GGUF_SCALARS[kind])[0]  # KeyError: a type this reader does not know

        tensors = []
        try:
            m.seek(4)
            (version,) = take("I")
            if version not in (2, 3):
                return GgufHeader(None, None, False)
            n_tensors, n_values = take("QQ")
            for _ in range(n_values):
                name = text()
                found[name] = value(take("I")[0])
            for _ in range(n_tensors):
                text()
                (dims,) = take("I")
                shape = take("Q" * min(dims, 8))
                kind, offset = take("IQ")
                tensors.append((math.prod(shape), kind, offset))
            end = m.tell()
        except (struct.error, ValueError):
            return GgufHeader(_named(found), None, True)
        except KeyError:
            return GgufHeader(_named(found), None, False)
    align = found.get("general.alignment")
    align = align if isinstance(align, int) and align > 0 else 32
    start = needs = -(-end // align) * align  # the tensors' data begins at the next multiple of the alignment
    for n, kind, offset in tensors:
        if kind not in GGML_QUANT_SIZES:
            return GgufHeader(_named(found), None, False)
        block, size = GGML_QUANT_SIZES[kind]
        needs = max(needs, start + offset + n // block * size)
    return GgufHeader(_named(found), needs, False)


def _named(found: dict[str, object]) -> str | None:
    architecture = found.get("general.architecture")
    return architecture if isinstance(architecture, str) else None


def _cut_short(file: Path, size: int) -> str:
    """Why `file` is cut short, naming the architecture its header gives; "" where it holds what its header says."""
    header = _gguf_header(file)
    named = (
        f"its header names architecture {header.architecture}"
        if header.architecture
        else "its header ends before it names an architecture"
    )
    if header.cut:
        return f"{file} is cut short: its header runs past the end of the file ({size} bytes); {named}"
    if header.needs is not None and size < header.needs:
        return (
            f"{file} is cut short ({size} of {header.needs} bytes: its tensors run past the end of the file); {named}"
        )
    return ""

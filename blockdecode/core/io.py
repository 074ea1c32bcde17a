"""Files that stay whole: atomic writes, folders replaced as a whole, JSONL logs, training checkpoints.

A reader, or a run killed mid-write, sees the old file or the new one, never half of one; and the
old set of files in a folder or the new set, never a mix of two saves."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one writer at a time is then the caller's to ensure
    fcntl = None


import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


class CheckpointError(ValueError):
    """A saved model or checkpoint that cannot be loaded as it is: missing, corrupt or mismatched."""


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Call write(tmp_path), then rename over `path`: readers see the old file or the new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:  # on disk before the rename makes it visible
            os.fsync(f.fileno())
        _share(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _share(path: Path) -> None:
    """Give `path`, and all below it, the mode `open` and `mkdir` would have given them: 0666 for a
    file, 0777 for a folder, less the umask. mkstemp and mkdtemp make theirs private (0600, 0700),
    and so does safetensors; a save would then be unreadable to another account (a serving engine's)."""
    umask = os.umask(0)
    os.umask(umask)
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~umask)


def cache_root() -> Path:
    """Where blockdecode caches what it measures and indexes: $XDG_CACHE_HOME/blockdecode, else ~/.cache/blockdecode."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "blockdecode"


def file_stamp(path: Path) -> list[int]:
    """What a cache compares to tell that a file may have changed without reading it: inode, size,
    modification and change time. A write that puts the modification time back still moves the change time."""
    info = Path(path).stat()
    return [info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def file_digest(path: Path) -> str:
    """A file's sha256, read in 1 MiB pieces (about 1 s for 500 MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            digest.update(piece)
    return digest.hexdigest()


def check_writable(out: Path, flag: str = "--out") -> None:
    """Refuse a folder that cannot be made or written, without making it, before any work: a run
    that fails later loses what it did and leaves nothing behind."""
    existing = Path(out).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise OSError(f"{flag} {out} cannot be written: {existing} is not a writable folder")


def save_figure(fig, path: Path) -> None:
    """A matplotlib figure as a PNG, written atomically, then closed (pyplot keeps every figure
    alive until it is)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)


def remove_temporaries(folder: Path) -> int:
    """Delete what a killed `atomic_write` left in `folder` (`.NAME.*.tmp`); how many."""
    leftovers = list(Path(folder).glob(".*.tmp")) if Path(folder).is_dir() else []
    for path in leftovers:
        path.unlink(missing_ok=True)
    return len(leftovers)


STAGING_PREFIX = ".save-"


@contextmanager
def _opened(folder: Path) -> Iterator[int | None]:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _lock(fd: int | None, mode: str) -> bool:
    """flock a folder's descriptor ("shared", "exclusive", or "try": exclusive if free now); False
    where it is held elsewhere or locks are unsupported. The kernel drops a lock when its process
    dies, so a killed writer never leaves one behind."""
    if fd is None or fcntl is None:
        return False
    flags = {"shared": fcntl.LOCK_SH, "exclusive": fcntl.LOCK_EX, "try": fcntl.LOCK_EX | fcntl.LOCK_NB}[mode]
    try:
        fcntl.flock(fd, flags)
    except OSError:
        return False
    return True


def _abandoned(folder: Path) -> list[Path]:
    """Staging folders no live writer holds, oldest first."""
    found = []
    for staging in folder.glob(STAGING_PREFIX + "*"):
        with _opened(staging) as fd:
            if fd is not None and (fcntl is None or _lock(fd, "try")):  # None: finished meanwhile
                found.append((os.fstat(fd).st_mtime_ns, staging))
    return [staging for _, staging in sorted(found)]


def _move_in(staging: Path, folder: Path, last: str, replaces: Sequence[str] = ()) -> None:
    """Rename a complete save's files over the folder's, `last` (the file that marks it whole) last;
    first remove the files named in `replaces` that this save does not hold."""
    for name in replaces:
        if not (staging / name).exists():
            _remove(folder / name)
    for item in sorted(staging.iterdir(), key=lambda p: p.name == last):
        _share(item)
        target = folder / item.name
        if item.is_dir() and target.is_dir():
            shutil.rmtree(target)
        os.replace(item, target)
    staging.rmdir()


def _remove(path: Path) -> None:
    """A file or a folder, where there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _settle(folder: Path, last: str) -> None:
    """Finish saves killed while their files were being moved in, drop those killed before, and
    remove what a killed `atomic_write` left. Called with the folder locked exclusively."""
    for staging in _abandoned(folder):
        if (staging / last).exists():
            _move_in(staging, folder, last)
        else:
            shutil.rmtree(staging, ignore_errors=True)
    remove_temporaries(folder)


@contextmanager
def saving_folder(folder: Path, last: str, replaces: Sequence[str] = (), whole: bool = False) -> Iterator[Path]:
    """Write a new save of `folder`'s files into the yielded staging folder, `last` last; on exit
    they replace the old ones while no reader (`reading_folder`) holds the folder. Killed before
    `last` is written, the save is dropped by the next save or read; killed after, it is finished.
    `replaces`: files (or folders) an earlier save may hold that this one writes only at times (a
    plot it did not draw): the swap removes those it lacks, so the folder holds one save's set, never
    two. `whole`: the save replaces everything in the folder, whatever an earlier save held."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder, prefix=STAGING_PREFIX))
    with _opened(staging) as alive:
        _lock(alive, "exclusive")  # held while this writer lives: its staging is not abandoned
        try:
            yield staging
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        with _opened(folder) as fd:
            _lock(fd, "exclusive")
            _settle(folder, last)  # older interrupted saves first, so this one ends up on top
            if whole:
                replaces = [p.name for p in folder.iterdir() if not p.name.startswith(STAGING_PREFIX)]
            _move_in(staging, folder, last, replaces)


@contextmanager
def reading_folder(folder: Path, last: str) -> Iterator[None]:
    """Hold `folder` against a writer's swap while its files are read, after finishing a save
    that was killed half-way through its swap."""
    folder = Path(folder)
    with _opened(folder) as fd:
        _lock(fd, "shared")
        while any((s / last).exists() for s in _abandoned(folder)):
            _lock(fd, "exclusive")
            _settle(folder, last)
            _lock(fd, "shared")
        yield


@contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold `folder` exclusively while a file in it is read, changed and written back, so that two
    processes (or threads) updating it at once each keep the other's change."""
    with _opened(folder) as fd:
        _lock(fd, "exclusive")
        yield


def one_line(err: BaseException) -> str:
    """An exception's message on one line (transformers' and huggingface_hub's run over several)."""
    return " ".join(str(err).split())


def read_utf8(path: str | Path) -> str:
    """A text file's content; bytes that are not UTF-8 are a ValueError naming the file, where
    Python's own message names none."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text: {err}") from err


def read_json(path: str | Path, error: type[ValueError] = ValueError) -> object:
    """A JSON file's content. Bytes that are not UTF-8, a truncated file or nesting too deep for
    the parser are one `error` naming the file, where the decoder's own message names none."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except RecursionError as err:
        raise error(f"{path} is nested too deeply to be read as JSON") from err
    except ValueError as err:  # a UnicodeDecodeError or a JSONDecodeError
        raise error(f"{path} is not valid JSON: {err}") from err
    except OSError as err:  # a folder, or a file this process may not read
        raise error(f"{path} cannot be read: {err.strerror or err}") from err


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; missing, corrupt or cut short, one CheckpointError naming the file."""
    try:
        return load_file(str(path))
    except FileNotFoundError as err:
        raise CheckpointError(f"{path} is missing") from err
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path} is corrupt or truncated: {err}") from err


def read_prompts(path: str | Path) -> list[str]:
    """The prompt texts a JSON file lists (a model's prompts.json, bench --prompts); anything else
    in it is refused with the file's name."""
    texts = read_json(path)
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise ValueError(f"{path}: prompts must be a JSON list of non-empty strings")
    if not all(t == t.encode("utf-8", "surrogatepass").decode("utf-8", "ignore") for t in texts):
        raise ValueError(f"{path}: a prompt holds a lone surrogate, not text")
    return texts


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda p: Path(p).write_text(text, encoding="utf-8"))


def write_json(path: Path, data: object) -> None:
    write_text(path, json.dumps(data, indent=1) + "\n")


def save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object, so numpy adds no .npy to the temporary name
        np.save(f, array)


def load_npy(
    path: str | Path, mmap_mode: str | None = None, shape: tuple | None = None, dtype=None, remedy: str = ""
) -> np.ndarray:
    """A .npy array, memory-mapped in `mmap_mode` if given. A file that is no .npy array, is cut short,
    or (where `shape` and `dtype` are given) holds another layout is one ValueError naming it, then
    `remedy` (what to do): numpy's own ("the magic string is not correct") names neither, and takes
    a file of other bytes for a pickle. Mapped "r+" only once checked whole: numpy's "r+" grows a
    truncated file back with zeros."""
    then = f": {remedy}" if remedy else ""
    try:
        with open(path, "rb") as f:
            np.lib.format.read_magic(f)
        array = np.load(path, mmap_mode=mmap_mode and "r", allow_pickle=False)
    except (OSError, EOFError, ValueError) as err:
        raise ValueError(f"{path} is not a readable .npy array ({one_line(err)}){then}") from err
    if shape is not None and (array.shape, array.dtype, array.flags.c_contiguous) != (shape, np.dtype(dtype), True):
        order = "" if array.flags.c_contiguous else " in Fortran order"
        raise ValueError(f"{path} holds {array.dtype} {array.shape}{order}, not {np.dtype(dtype)} {shape}{then}")
    return np.load(path, mmap_mode=mmap_mode) if mmap_mode not in (None, "r") else array


def cached_npy(path: Path, shape: tuple, dtype, mmap_mode: str | None = None) -> np.ndarray | None:
    """A cache's array of `shape` and `dtype` at `path` (`load_npy`), or None where there is none
    yet, or it is damaged: a warning names the file, and the caller computes it again."""
    if not Path(path).is_file():
        return None
    try:
        return load_npy(path, mmap_mode, shape, dtype, remedy="computing it again")
    except ValueError as err:
        warnings.warn(str(err), stacklevel=3)
        return None


def read_jsonl(path: Path) -> list[dict]:
    """A JSONL log's records; a line that is not JSON (a write cut short) is one ValueError naming
    the file and the line, where the decoder's own message names neither."""
    path = Path(path)
    records = []
    for n, line in enumerate(path.read_text().splitlines() if path.is_file() else [], start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as err:
            raise ValueError(f"{path}:{n} is not a JSON record ({err}): the log is damaged; remove that line") from err
    return records


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(path: Path, state: dict) -> None:
    """A training state (tensors, optimizer, RNG) written atomically."""
    atomic_write(path, lambda p: torch.save(state, p))


def load_checkpoint(
    path: Path,
    cfg: object,
    must_match: Sequence[str],
    data_digest: str | None = None,
    meaning: Callable[[str, object], object] | None = None,
) -> dict:
    """A training checkpoint, refused with a clear error if damaged, saved by a run whose
    `must_match` settings differ from cfg's, or trained on data whose content (`data_digest`, a
    fingerprint of the tokens, so a moved folder still resumes and an edited one does not) differs.
    A setting the saved config lacks (a checkpoint older than the setting, or than its check) is
    not a difference: such checkpoints stay resumable. `meaning(name, value)`, where given, is what a
    setting means (a path resolved, a default filled in): settings spelt differently that mean the same match."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        saved = state["config"]
    except Exception as err:  # torch raises many types for a damaged file
        raise ValueError(f"--resume: the checkpoint {path} is corrupt: {err}") from err
    same = (lambda n, a, b: a == b) if meaning is None else (lambda n, a, b: a == b or meaning(n, a) == meaning(n, b))
    for name in must_match:
        if name in saved and not same(name, saved[name], getattr(cfg, name)):
            raise ValueError(
                f"--resume: the checkpoint in {Path(path).parent} has {name}={saved.get(name)!r}, this run asks "
                f"for {getattr(cfg, name)!r}"
            )
    trained_on = state.get("data_digest")
    if data_digest is not None and trained_on is not None and trained_on != data_digest:
        raise ValueError(
            f"--resume: the checkpoint in {Path(path).parent} was trained on other data (tokens {trained_on}, "
            f"now {data_digest}): the data files changed since"
        )
    return state


def read_text(path: Path) -> str:
    """A source file as text; some stdlib test files are not valid UTF-8."""
    return path.read_bytes().decode("utf-8", errors="replace")

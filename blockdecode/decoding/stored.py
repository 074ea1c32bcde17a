"""The calibration cache, `~/.cache/blockdecode/calibration.json`: what was measured of this machine (cost curves,
the heads' time) and what `tree="auto"` chose, each under a key naming what it hangs on.

It is read once per process and holds at most `CACHE_ENTRIES` entries, the oldest dropped. It can never stop a
decode: a damaged file or entry is noted and measured again, an entry is merged into the file under a lock (two
processes storing at once both stay), and one that cannot be stored is used anyway, with one line."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from blockdecode.core.io import cache_root, locked, read_json, write_json

CACHE_ENTRIES = 256

_CACHE: dict[str, dict] = {}  # cache file -> its entries, read once per process
_UNWRITABLE: set[str] = set()  # cache files already warned about


def cache_file() -> Path:
    return cache_root() / "calibration.json"


def note(message: str) -> None:
    """One line on stderr: what was wrong with a file (named in `message`), and that it is measured again."""
    print(f"blockdecode: {message}; measuring again", file=sys.stderr)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def read_cache(path: Path, quiet: bool = False) -> dict:
    """The cached entries in `path`: none when it is missing, or damaged (then noted unless `quiet`),
    so that everything it held is measured again, never trusted."""
    if not path.is_file():
        return {}
    try:
        stored = read_json(path)
        if not isinstance(stored, dict):
            raise ValueError(f"{path} holds a JSON {type(stored).__name__}, not an object of choices")
    except ValueError as err:
        if not quiet:
            note(str(err))
        return {}
    return stored


def entries() -> dict:
    """This process's view of the cache file: read once, then kept in step with what it stores."""
    path = cache_file()
    if str(path) not in _CACHE:
        _CACHE[str(path)] = read_cache(path)
    return _CACHE[str(path)]


def _stored_at(entry: object) -> float:
    stored = entry.get("stored") if isinstance(entry, dict) else None
    return stored if is_number(stored) else 0.0


def store(key: str, entry: dict) -> str:
    """Add `entry` under `key` to the cache file, merged under its folder's lock with what other processes stored
    meanwhile; "" once stored, else why not. Kept in memory either way, so it is not measured again in this
    process."""
    path, entry = cache_file(), {**entry, "stored": time.time()}
    entries()[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path.parent):
            kept = {k: v for k, v in read_cache(path, quiet=True).items() if k != key}
            kept[key] = entry
            for old in sorted(kept, key=lambda k: _stored_at(kept[k]))[: max(0, len(kept) - CACHE_ENTRIES)]:
                del kept[old]
            write_json(path, kept)
    except OSError as err:
        return f"not cached: {path} cannot be written ({err.strerror or err})"
    _CACHE[str(path)] = kept
    return ""


def say_once(why: str, then: str) -> None:
    """Say, once per cache file and process, that something could not be stored (`why`) and what is done instead."""
    if why and str(cache_file()) not in _UNWRITABLE:
        _UNWRITABLE.add(str(cache_file()))
        print(f"blockdecode: {why}; {then}", file=sys.stderr)

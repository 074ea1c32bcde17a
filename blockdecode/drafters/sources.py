"""What suffix lookup drafts from beside the sequence itself: a model's remembered outputs, and a corpus
the user names, both held as suffix arrays.

A suffix array (`SuffixArray`) is the documents' tokens, each document ended by a separator, and the
start of every suffix sorted by its first `SORTED` tokens, ties by position. numpy sorts it by prefix
doubling (stable argsorts of rank pairs, at most log2(SORTED) = 7 of them), so a corpus of millions of
tokens is indexed in seconds, held in 8 bytes a token (both arrays int32, plus the same again as the bytes
that lookups compare) and cached as two .npy files. The occurrences of a string are one range of the
array, found by binary search; what followed them is sorted within it, so each continuation's count is a
sub-range. A suffix automaton (`blockdecode.drafters.suffix.SuffixIndex`) answers the same questions faster a
lookup but costs about 400 bytes a token and cannot drop a document: it stays for the sequence being
decoded, which grows a token at a time.

`Memory`, a model's earlier outputs in this process: each remembered as a document; the newest in a
small young array rebuilt whole at each addition, the rest in one old array rebuilt when the young one
fills, which is when the oldest documents are dropped to keep the total under `limit` tokens. A reader
takes the pair as it stands (`snapshot`): one decode reads one consistent state while others add.

Measured (numpy 2, one core of a shared 2-core AMD EPYC; lookups: `SuffixDrafter.chain` of 8 and a
24-node trie of depth 8 for 512-token contexts not in the index; docs/design.md, *Suffix lookup*):

- 1M random ids over 8,192: indexed in 0.3-0.6 s, 11 MiB held (0.40 GiB peak RSS while sorting); chain
  0.16-0.18 ms median (0.27 at p90), trie 0.24 ms (0.33).
- 10M random ids: 5.5-10.8 s, 114 MiB (0.93 GiB peak); chain 0.56 ms (0.63), trie 0.72 ms (0.90): the
  1-token matches' ~1,200 occurrences take the sampled path, where numpy's per-call overhead dominates.
- 0.96M tokens of the standard library (built-in tokenizer, 1.3 s to tokenize): 0.6-0.7 s; chain 0.14 ms
  (0.54 at p90), trie 0.20 ms (0.92), before the small-range and sampled-bound speedups.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from blockdecode.core.io import atomic_write, cache_root, file_stamp, load_npy, read_json, save_npy, write_json

SORTED = 128  # the tokens each suffix is sorted by: a match and the continuation read after it, at most
DEPTH = 64  # the deepest continuation counted (blockdecode.drafters.suffix reads no deeper)
LONGEST = SORTED - DEPTH  # the longest match a suffix array finds
FEW = 32  # up to this many occurrences, their continuations are counted in plain Python
WIDE = 512  # past this many occurrences, a string's continuations are found from this many of them, spread evenly
SEPARATOR = -1  # ends each document: no string runs across two


def sort_suffixes(tokens: np.ndarray) -> np.ndarray:
    """The starts of the suffixes of `tokens` (int32, documents ended by SEPARATOR) that start with a token,
    sorted by their first SORTED tokens (a separator, or the end, before any token), ties by position."""
    n = len(tokens)
    key = tokens.astype(np.int64) + 1  # the separator 0, below every token
    order = np.argsort(key, kind="stable")
    span = 1
    while True:
        ranked = key[order]
        rank = np.empty(n, np.int64)
        rank[order] = np.concatenate(([0], np.cumsum(ranked[1:] != ranked[:-1])))  # dense ranks of `span` tokens
        if span >= SORTED or rank[order[-1]] == n - 1:  # sorted deep enough, or every suffix apart
            break
        after = np.zeros(n, np.int64)
        after[:-span] = rank[span:]
        key = rank * (n + 1) + after
        order = np.argsort(key, kind="stable")
        span *= 2
    return order[tokens[order] != SEPARATOR].astype(np.int32)


def joined(documents: Iterable[Sequence[int]]) -> np.ndarray:
    """Documents' tokens one after another, each ended by the separator, as int32."""
    parts = [np.append(np.asarray(doc, dtype=np.int32), np.int32(SEPARATOR)) for doc in documents]
    return np.concatenate(parts) if parts else np.array([SEPARATOR], np.int32)


class SuffixArray:
    """Documents' suffixes, sorted (`sort_suffixes`), asked about as `blockdecode.drafters.suffix` asks a
    SuffixIndex: a node is the range [lo, hi) of the suffixes that start with the string, and its length."""

    def __init__(self, tokens: np.ndarray, order: np.ndarray):
        self.tokens, self.order = tokens, order
        self.size = len(order)  # tokens held (separators aside)
        self._starts = memoryview(order)  # Python ints on indexing, without copying the array
        self._ids = memoryview(tokens)
        self._bytes = (tokens.astype(np.int64) + 1).astype(">u4").tobytes()  # compared as bytes: big-endian

    @classmethod
    def of(cls, documents: Iterable[Sequence[int]]) -> SuffixArray:
        tokens = joined(documents)
        return cls(tokens, sort_suffixes(tokens))

    def __repr__(self) -> str:
        return f"SuffixArray({self.size} tokens)"

    def _range(self, pattern: Sequence[int], exists: bool = False) -> tuple[int, int]:
        """The suffixes that start with `pattern` (at most SORTED tokens); `exists`: an empty range if
        none does, else a range holding one that does, found by one binary search."""
        data, width, starts = self._bytes, 4 * len(pattern), self._starts
        key = (np.asarray(pattern, np.int64) + 1).astype(">u4").tobytes()

        def head(start: int) -> bytes:
            return data[4 * start : 4 * start + width]

        lo = bisect.bisect_left(starts, key, key=head)
        if exists:
            return lo, lo + (lo < self.size and head(starts[lo]) == key)
        return lo, bisect.bisect_right(starts, key, lo, key=head)

    def finder(self, context: Sequence[int], most: int):
        """The longest suffix of `context` (at most `most` tokens, and LONGEST) held here, and a function
        giving the node of the suffix of each length up to it (each length's occurrences, found when asked)."""
        context = list(context[max(0, len(context) - min(most, LONGEST)) :])
        low, high = 0, len(context)  # the longest held lies in [low, high]: a shorter suffix occurs if a longer does
        while low < high:
            mid = (low + high + 1) // 2
            lo, hi = self._range(context[-mid:], exists=True)
            low, high = (mid, high) if hi > lo else (low, mid - 1)
        known: dict[int, tuple[int, int, int]] = {}

        def node(size: int) -> tuple[int, int, int] | None:
            if size > low:
                return None
            if size not in known:
                known[size] = (*self._range(context[-size:]), size)
            return known[size]

        return low, node

    def _keys(self, at: np.ndarray, offset: int) -> np.ndarray:
        """The token `offset` after the start of each suffix at positions `at` of the sorted order."""
        return self.tokens[self.order[at] + offset]

    def _bounds(
        self, node: tuple[int, int, int], values: np.ndarray, at: np.ndarray, keys: np.ndarray, right: bool
    ) -> np.ndarray:
        """For each value, the first position in the node's range whose next token is above it (`right`)
        or not below it: the range is sorted by that token, so a binary search each, all at once, each
        between the two samples (positions `at`, tokens `keys`) it lies between."""
        lo, hi, offset = node
        j = np.searchsorted(keys, values, "right" if right else "left")
        low = np.where(j > 0, at[np.maximum(j - 1, 0)] + 1, lo)
        high = np.append(at, hi)[j]
        while (low < high).any():
            mid = (low + high) // 2
            keys = self._keys(np.minimum(mid, hi - 1), offset)
            below = (keys <= values) if right else (keys < values)
            below &= low < high
            low = np.where(below, mid + 1, low)
            high = np.where(below | (low >= high), high, mid)
        return low

    def children(self, node: tuple[int, int, int]) -> list[tuple[int, int, int, tuple[int, int, int]]]:
        """What followed the node's string: (token, how often, where it last began, its node). Past WIDE
        occurrences the tokens are those of WIDE of them spread evenly (any token that followed more than
        1 in WIDE of them is among them), each counted exactly, and 'where it last began' is its range's
        last suffix's start."""
        lo, hi, offset = node
        if hi - lo <= FEW:  # the common case past the first token or two: numpy's overhead is what costs
            ids, starts, found = self._ids, self._starts, {}
            for i in range(lo, hi):
                start = starts[i]
                token = ids[start + offset]
                first, _, newest = found.get(token, (i, i, -1))
                found[token] = (first, i + 1, max(newest, start))
            return [(t, b - a, new, (a, b, offset + 1)) for t, (a, b, new) in found.items() if t != SEPARATOR]
        if hi - lo <= WIDE:
            keys = self._keys(np.arange(lo, hi), offset)
            cuts = np.flatnonzero(np.diff(keys)) + 1
            firsts = np.concatenate(([0], cuts))
            lasts = np.concatenate((cuts, [hi - lo]))
            newest = np.maximum.reduceat(self.order[lo:hi], firsts)
            found = zip(keys[firsts].tolist(), (lo + firsts).tolist(), (lo + lasts).tolist(), newest.tolist())
        else:
            at = lo + (np.arange(WIDE) * (hi - lo)) // WIDE
            keys = self._keys(at, offset)
            tokens = np.unique(keys)
            firsts, lasts = (self._bounds(node, tokens, at, keys, right) for right in (False, True))
            found = zip(tokens.tolist(), firsts.tolist(), lasts.tolist(), self.order[lasts - 1].tolist())
        return [(t, b - a, new, (a, b, offset + 1)) for t, a, b, new in found if t != SEPARATOR]

    def went_on(self, node: tuple[int, int, int]) -> int:
        """How many occurrences of the node's string went on (did not end a document)."""
        lo, hi, offset = node
        data, start = self._bytes, 4 * offset
        ended = bisect.bisect_right(
            self._starts, bytes(4), lo, hi, key=lambda p: data[4 * p + start : 4 * p + start + 4]
        )
        return hi - ended


@dataclass(frozen=True)
class MemoryConfig:
    """How much of a model's earlier output suffix lookup keeps: `limit` tokens in all (about 12 bytes
    each), the oldest outputs dropped first; the newest `young` tokens in an array rebuilt whole at each
    addition (under a few ms at 16k), the rest in one rebuilt when that fills (about 1 s a million)."""

    limit: int = 1_000_000
    young: int = 16_384


class Memory:
    """A model's outputs in this process, as documents for suffix lookup (`MemoryConfig`); threads add
    and read at once: additions are made one at a time, and a reader's snapshot is never changed. A copy
    (deepcopy, pickle) starts empty: what a process remembered stays in it."""

    def __init__(self, config: MemoryConfig = MemoryConfig()):
        self.config = config
        self._adding = threading.Lock()
        self._clear()

    def __reduce__(self) -> tuple:
        return Memory, (self.config,)

    def _clear(self) -> None:
        self._old: list[list[int]] = []  # documents, oldest first
        self._young: list[list[int]] = []
        self._old_array: SuffixArray | None = None
        self._view: tuple[SuffixArray, ...] = ()  # the young array, then the old: newest first

    @property
    def tokens(self) -> int:
        """How many tokens are remembered."""
        return sum(array.size for array in self._view)

    def snapshot(self) -> tuple[SuffixArray, ...]:
        return self._view

    def forget(self) -> None:
        with self._adding:
            self._clear()

    def add(self, documents: Iterable[Sequence[int]]) -> None:
        """Remember `documents` (a decode's rows); a document longer than the limit keeps its newest tokens."""
        limit = self.config.limit
        documents = [list(doc)[-limit:] for doc in documents if len(doc)]
        if not documents:
            return
        with self._adding:
            young, old = [*self._young, *documents], self._old_array
            if sum(map(len, young)) > self.config.young:  # the young ones join the old, the oldest dropped to fit
                kept, total = [], 0
                for doc in reversed([*self._old, *young]):
                    if total + len(doc) > limit - self.config.young:
                        break
                    kept.append(doc)
                    total += len(doc)
                self._old, young = kept[::-1], []
                old = SuffixArray.of(self._old) if self._old else None
            self._young, self._old_array = young, old
            self._view = tuple(a for a in (SuffixArray.of(young) if young else None, old) if a is not None)


CACHE_VERSION = 1
BATCH = 64  # files tokenized a call (a fast tokenizer splits a batch over the cores)


def cache_dir() -> Path:
    """Where corpus indexes are cached: $XDG_CACHE_HOME/blockdecode/corpus, else ~/.cache/blockdecode/corpus."""
    return cache_root() / "corpus"


@dataclass(frozen=True)
class CorpusTexts:
    """What a corpus names, read: its texts, what names it (each path resolved, each text's hash), and a
    hash of the texts' content."""

    texts: list[str]
    names: list[str]
    content: str


def corpus_items(items: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str | os.PathLike]:
    """A corpus's items as a list, read once (a generator too), each a path or a str: anything else is refused in
    one line, as is an empty str (Path("") is the current folder, read whole: never meant)."""
    items = [items] if isinstance(items, str | os.PathLike) else list(items)
    for item in items:
        if not isinstance(item, str | os.PathLike):
            ids = " (token ids go to SuffixDrafter(corpus=...))" if isinstance(item, list | tuple | int) else ""
            raise TypeError(f"corpus takes paths and strings, got {type(item).__name__}{ids}")
        if isinstance(item, str) and not item.strip():
            raise ValueError("corpus: an empty string names nothing: give files, folders or texts")
    return items


def corpus_texts(items: str | os.PathLike | Sequence[str | os.PathLike]) -> CorpusTexts:
    """The texts a corpus names: a Path, or a str naming an existing file or folder, is read (folders
    recursively, in name order); any other str with a space or a line break in it is text. One word that
    names nothing is taken for a mistyped path, not a text to draft from: one ValueError naming it, as for
    a path that cannot be read. Files that are not UTF-8 text (or hold NUL bytes) are skipped with one note."""
    texts, names, skipped = [], [], []
    for item in corpus_items(items):
        path = Path(item)
        if _is_text(item):
            texts.append(item)
            names.append("text " + _digest(item))
            continue
        if not _exists(path) and isinstance(item, str):  # one word: a path mistyped, not a text worth drafting from
            raise ValueError(f"corpus: {item} is neither a file nor a folder (a text to draft from has spaces)")
        if not _exists(path):
            raise ValueError(f"corpus: {path} does not exist")
        for file in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
            text = _read(file)
            if text is None:
                skipped.append(file)
            else:
                texts.append(text)
                names.append(str(file.resolve()))
    if skipped:
        many = f"{len(skipped)} files that are" if len(skipped) > 1 else "1 file that is"
        print(f"note: corpus: skipped {many} not UTF-8 text, e.g. {skipped[0]}", file=sys.stderr)
    return CorpusTexts(texts, names, _digest("".join(_digest(t) for t in texts)))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _is_text(item: str | os.PathLike) -> bool:
    """Whether a corpus item is a text to draft from: a str of more than one word that names no file or folder."""
    return isinstance(item, str) and len(item.split(maxsplit=1)) > 1 and not _exists(Path(item))


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long for a path, or one holding NUL: text
        return False


def _read(file: Path) -> str | None:
    """A file's text; None if it is binary (NUL bytes, or not UTF-8)."""
    try:
        data = file.read_bytes()
    except OSError as err:
        raise ValueError(f"corpus: {file} cannot be read: {err.strerror or err}") from err
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def tokenizer_digest(tokenizer) -> str:
    """What a tokenizer turns text into, as a hash: its class and vocabulary (ids by token)."""
    return _digest(json.dumps([type(tokenizer).__name__, sorted(tokenizer.get_vocab().items())]))


_LOADED: dict[tuple, tuple[weakref.ref, SuffixArray]] = {}  # a corpus's stamp -> its tokenizer, its index
_LOADING = threading.Lock()


def corpus_index(
    tokenizer, items: str | os.PathLike | Sequence[str | os.PathLike], progress: bool = True
) -> SuffixArray:
    """The suffix array of a corpus (`corpus_texts`) tokenized by `tokenizer`: as this process last loaded
    it while no file's size or time changed; else read from the cache when this tokenizer indexed these
    names with this content before; else built, with a progress bar, and cached in place of any older
    index of the same names (a changed file, or a damaged cache, is said in one line)."""
    items = corpus_items(items)  # once: a generator is read here, not spent by the stamp
    stamp = corpus_stamp(items)
    with _LOADING:
        known = _LOADED.get(stamp)
        if known is None or known[0]() is not tokenizer:
            _LOADED[stamp] = known = (weakref.ref(tokenizer), _index(tokenizer, items, progress))
    return known[1]


def corpus_stamp(items: str | os.PathLike | Sequence[str | os.PathLike]) -> tuple:
    """What a corpus names as it stands: each file's path, inode, size and times (a write that restores the
    modification time still moves the change time), each text's hash."""
    stamp = []
    for item in corpus_items(items):
        path = Path(item)
        if _is_text(item):
            stamp.append(_digest(item))
            continue
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            try:
                stamp.append((str(file), *file_stamp(file)))
            except OSError:  # reading it says why
                stamp.append(str(file))
    return tuple(stamp)


def _index(tokenizer, items: str | os.PathLike | Sequence[str | os.PathLike], progress: bool) -> SuffixArray:
    corpus = corpus_texts(items)
    folder = cache_dir() / _digest(json.dumps([CACHE_VERSION, tokenizer_digest(tokenizer), corpus.names]))
    cached = _cached(folder, corpus.content)
    if cached is not None:
        return cached
    documents = []
    for start in _progress(range(0, len(corpus.texts), BATCH), len(corpus.texts), progress):
        documents += tokenizer(corpus.texts[start : start + BATCH], add_special_tokens=False).input_ids
    array = SuffixArray.of(documents)
    try:
        atomic_write(folder / "tokens.npy", lambda p: save_npy(p, array.tokens))
        atomic_write(folder / "order.npy", lambda p: save_npy(p, array.order))
        sums = {"content": corpus.content, "tokens": _sum(array.tokens), "order": _sum(array.order)}
        write_json(folder / "index.json", sums)  # last: it marks the index whole
    except OSError as err:  # the index is still good for this process
        print(f"note: corpus: its index cannot be cached in {folder} ({err.strerror or err}); drafting from it "
              "uncached", file=sys.stderr)  # fmt: skip
    return array


def _sum(array: np.ndarray) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()


def _cached(folder: Path, content: str) -> SuffixArray | None:
    """The index cached in `folder` for this content, checked against its sums; None if there is none,
    or it is of other content or damaged (each said in one line)."""
    if not (folder / "index.json").is_file():
        return None
    try:
        sums = read_json(folder / "index.json")
        if not isinstance(sums, dict) or sums.get("content") != content:
            print("note: corpus: its files changed since they were indexed; indexing again", file=sys.stderr)
            return None
        tokens, order = load_npy(folder / "tokens.npy"), load_npy(folder / "order.npy")
        if (_sum(tokens), _sum(order)) != (sums.get("tokens"), sums.get("order")) or tokens.dtype != np.int32:
            raise ValueError("its files do not match their sums")
    except ValueError as err:
        print(f"note: corpus: the cached index in {folder} is damaged ({err}); indexing again", file=sys.stderr)
        return None
    return SuffixArray(tokens, order)


def _progress(batches: range, files: int, show: bool) -> Iterable[int]:
    """The batches, with a progress bar on stderr, in files, where there are several."""
    return _bar(batches, files) if show and files > 1 else batches


def _bar(batches: range, files: int) -> Iterable[int]:
    from tqdm import tqdm

    bar = tqdm(total=files, desc="indexing the corpus", unit="file", file=sys.stderr, leave=False)
    for start in batches:
        yield start
        bar.update(min(BATCH, files - start))
    bar.close()

"""The corpus (the Python standard library's sources, or the user's `--data`) as
bytes, its held-out split, and the batches: a function of the seed and the step."""

import functools
import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .config import RunConfig, UsageError


class Corpus(NamedTuple):
    """The bytes a run trains on (`train`) and evaluates on (`val`, the tail)."""

    train: np.ndarray  # uint8
    val: np.ndarray  # uint8
    sha256: str  # of the bytes before the split
    source: str  # for messages: where the bytes came from


def stdlib_sources(root: Path) -> Iterator[Path]:
    """The `.py` files under `root`, in sorted path order, lazily; third-party
    packages (`site-packages`, `dist-packages`) and `__pycache__` are skipped."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    for e in sorted(os.scandir(root), key=lambda e: e.name):
        if e.is_dir(follow_symlinks=False):
            if e.name not in skip:
                yield from stdlib_sources(Path(e.path))
        elif e.name.endswith(".py") and e.is_file():
            yield Path(e.path)


def text_files(root: Path) -> Iterator[Path]:
    """The text files under the directory `root`, in sorted path order, lazily:
    hidden files and directories (`.git`, ...) are skipped, and so are binary
    files (a NUL byte in the first 8 KiB, as git tells them)."""
    for e in sorted(os.scandir(root), key=lambda e: e.name):
        if e.name.startswith("."):
            continue
        if e.is_dir():
            yield from text_files(Path(e.path))
        elif e.is_file() and not _binary(Path(e.path)):
            yield Path(e.path)


def _binary(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" in f.read(8192)


def _files(data: str | None) -> Iterator[Path]:
    if data is None:
        return stdlib_sources(Path(sysconfig.get_paths()["stdlib"]))
    path = Path(data)
    return iter([path]) if path.is_file() else text_files(path)


@functools.lru_cache(maxsize=4)
def load_corpus(
    data: str | None = None, max_bytes: int | None = None
) -> tuple[np.ndarray, str]:
    """The bytes of `data` (a file, or every file of a directory joined in sorted
    path order; `None`: the standard library's `.py` sources), at most
    `max_bytes`, as one `uint8` array, and their SHA-256."""
    chunks, total = [], 0
    for path in _files(data):
        chunk = path.read_bytes()
        if max_bytes is not None:
            chunk = chunk[: max_bytes - total]
        chunks.append(chunk)
        total += len(chunk)
        if max_bytes is not None and total >= max_bytes:
            break
    raw = b"".join(chunks)
    return np.frombuffer(raw, dtype=np.uint8), hashlib.sha256(raw).hexdigest()


def corpus_for(c: RunConfig) -> Corpus:
    """The run's corpus, split; too little text for one sequence in either part is
    a `UsageError`."""
    corpus, digest = load_corpus(c.data, c.data_bytes)
    split = len(corpus) - int(len(corpus) * c.val_fraction)
    train, val = corpus[:split], corpus[split:]
    source = "the standard library" if c.data is None else f"--data {c.data}"
    if min(len(train), len(val)) <= c.seq:
        raise UsageError(
            f"The corpus ({source}: {len(corpus)} bytes, {len(val)} held out) is "
            f"too small for --seq {c.seq}: each part needs more than {c.seq} bytes. "
            "Give more text, a shorter --seq, or another --val-fraction"
            + (" or --data-bytes." if c.data_bytes else ".")
        )
    return Corpus(train, val, digest, source)


def sample(
    data: np.ndarray,
    seq: int,
    batch: int,
    seed: Sequence[int],
    rows: slice = slice(None),
) -> np.ndarray:
    """`batch` windows of `seq + 1` bytes at offsets drawn from `seed`: int32
    `(batch, seq + 1)`, inputs `[:, :-1]` and next-byte targets `[:, 1:]`. With
    `rows`, only those rows of that batch are read (a process's share)."""
    starts = np.random.default_rng(list(seed)).integers(0, len(data) - seq, batch)
    return data[starts[rows, None] + np.arange(seq + 1)].astype(np.int32)

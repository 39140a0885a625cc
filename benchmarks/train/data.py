"""The corpus (the standard library's `.py` sources, or `--data`) as bytes, its
held-out split, and its batches: a function of the seed and the step."""

import functools
import hashlib
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .config import RunConfig, UsageError
from .files import text_files, walk


class Corpus(NamedTuple):
    train: np.ndarray  # uint8
    val: np.ndarray  # uint8: the held-out tail
    sha256: str  # of the bytes before the split
    source: str  # where the bytes came from, for messages


def _files(data: str | None) -> Iterator[Path]:
    if data is not None:
        return iter([Path(data)]) if Path(data).is_file() else text_files(Path(data))
    stdlib = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__"}
    is_source = lambda e: e.name.endswith(".py")
    return walk(stdlib, lambda name: name not in skip, is_source, follow=False)


@functools.lru_cache(maxsize=4)
def load_corpus(
    data: str | None = None, max_bytes: int | None = None
) -> tuple[np.ndarray, str]:
    """The bytes of `data` (a file, or a directory's `text_files` joined; `None`:
    the standard library's `.py` sources), at most `max_bytes`, as one `uint8`
    array, and their SHA-256."""
    chunks, total = [], 0
    for path in _files(data):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if max_bytes is not None and total >= max_bytes:
            break
    raw = b"".join(chunks)[:max_bytes]
    return np.frombuffer(raw, dtype=np.uint8), hashlib.sha256(raw).hexdigest()


def corpus_for(c: RunConfig) -> Corpus:
    """The run's corpus, split; a `UsageError` if either part is not longer than
    one sequence."""
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
    data: np.ndarray, seq: int, batch: int, seed: Sequence[int], rows=slice(None)
) -> np.ndarray:
    """The rows `rows` of a batch of `batch` windows of `seq + 1` bytes at offsets
    drawn from `seed`, as int32 (inputs `[:, :-1]`, next-byte targets `[:, 1:]`)."""
    starts = np.random.default_rng(list(seed)).integers(0, len(data) - seq, batch)
    return data[starts[rows, None] + np.arange(seq + 1)].astype(np.int32)

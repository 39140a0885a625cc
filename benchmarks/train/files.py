"""Files: a fresh run directory, the text files of a corpus, and why a
`--data` path cannot be read (whether `--save-dir` can be written in:
`benchmarks/_files.py`). Imported by both the flags (`config`) and the corpus
(`data`), and importing neither."""

import datetime
import os
from collections.abc import Callable, Iterator
from pathlib import Path


RUNS = Path(__file__).resolve().parents[1] / "runs"  # benchmarks/runs


def run_dir(script: str) -> Path:
    """A fresh `benchmarks/runs/<script>-<date>/`, so nothing is overwritten."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return RUNS / f"{script}-{stamp}"


def walk(
    root: str, keep_dir: Callable, keep_file: Callable, follow: bool = True
) -> Iterator[Path]:
    """The files under `root` that `keep_file(entry)` keeps, in sorted path order,
    lazily; only the directories whose name `keep_dir` keeps are entered."""
    for e in sorted(os.scandir(root), key=lambda e: e.name):
        if e.is_dir(follow_symlinks=follow):
            if keep_dir(e.name):
                yield from walk(e.path, keep_dir, keep_file, follow)
        elif e.is_file() and keep_file(e):
            yield Path(e.path)


def text_files(root: Path) -> Iterator[Path]:
    """The text files under `root`, skipping hidden files and directories, and
    binary files (a NUL byte in the first 8 KiB, as git tells them)."""
    visible = lambda name: not name.startswith(".")
    return walk(root, visible, lambda e: visible(e.name) and not _binary(e.path))


def _binary(path: str) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def data_problem(path: Path) -> str | None:
    """Why `--data path` cannot be read, or `None`."""
    if not path.exists():
        return f"{path} does not exist."
    if path.is_file():
        return None if path.stat().st_size else f"{path} is empty."
    if not path.is_dir():
        return f"{path} is neither a file nor a directory."
    if not any(p.stat().st_size for p in text_files(path)):
        return (
            f"{path} holds no text file with any bytes (hidden and binary files "
            "are skipped)."
        )
    return None

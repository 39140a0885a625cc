"""Whether a directory can be written in: the measuring scripts' `--out` and
the training script's `--save-dir`. Imports nothing of `benchmarks`, so that
the training package may import it."""

import tempfile
from pathlib import Path


def writable_problem(path: Path) -> str | None:
    """Why `path` cannot be a directory to write in, or `None`: tried (the missing
    directories made, a file written), then what was made removed again."""
    made = []
    try:
        for parent in [*reversed(path.absolute().parents), path.absolute()]:
            if not parent.exists():
                parent.mkdir()
                made.append(parent)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return str(e.strerror or e)
    finally:
        for d in reversed(made):
            d.rmdir()
    return None

"""`python -m benchmarks.train` (and `python benchmarks/train_lm.py`)."""

import sys
from collections.abc import Sequence

from .config import UsageError
from .loop import main


def run(argv: Sequence[str] | None = None) -> None:
    """`main`, with a bad command line or checkpoint as one `error:` line, rc 2."""
    try:
        main(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"train_lm.py: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run()

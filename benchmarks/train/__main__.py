"""`python -m benchmarks.train` (and `python benchmarks/train_lm.py`)."""

from .loop import cli


cli()

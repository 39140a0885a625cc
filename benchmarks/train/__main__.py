"""`python -m benchmarks.train`, as `python benchmarks/train_lm.py`."""

from .loop import cli


cli()

"""Train `zoo.Transformer` on bytes: `python benchmarks/train_lm.py --help`.

The script lives in the package `benchmarks/train/` (`config`, `data`, `model`,
`checkpointing`, `metrics`, `loop`); this file is its command line,
as `python -m benchmarks.train` is."""

from benchmarks.train import RunConfig as RunConfig, UsageError as UsageError, main
from benchmarks.train.loop import cli


__all__ = ["RunConfig", "UsageError", "main"]

if __name__ == "__main__":
    cli()

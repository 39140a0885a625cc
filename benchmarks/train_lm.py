"""Train `zoo.Transformer` on bytes (`--help`); the code is `benchmarks/train/`."""

from benchmarks.train import RunConfig, UsageError, main
from benchmarks.train.loop import cli


__all__ = ["RunConfig", "UsageError", "main"]

if __name__ == "__main__":
    cli()

"""Train `zoo.Transformer` on bytes: the Python standard library, or your text.

A byte-level causal language model, optax AdamW with a warmup + cosine (or
constant) learning rate. `--data PATH` reads a text file or a directory's text
files (default: the standard library's `.py` sources); the last `--val-fraction`
is held out.

    python benchmarks/train_lm.py --steps 300 --save-dir runs/lm
    python benchmarks/train_lm.py --resume --save-dir runs/lm --remat recursive
    python benchmarks/train_lm.py --data my_texts/ --remat every:2:dots
    tensorboard --logdir runs/lm
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python benchmarks/train_lm.py --mesh fsdp:8 --batch 32 --device cpu

SIGTERM or Ctrl-C: the step finishes, is saved, exit 0 (with `--distributed`,
every process stops after the same step). `--resume` continues bit for bit from
the newest checkpoint whose SHA-256 still matches, under the run's saved
`--remat` unless one is given (a line says when it changes); `--steps` may grow if
the steps taken keep their learning rates. The run directory holds
`metrics.jsonl` (loss, held-out loss, lr, tokens/s, MFU, HFU, peak memory), the
same as TensorBoard events, and `loss.png`. More: docs/tutorials/training.md.
(`python -m benchmarks.train` is the same command.)
"""

from .config import RunConfig as RunConfig, UsageError as UsageError
from .loop import TrainResult as TrainResult, main as main

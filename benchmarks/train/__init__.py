"""Train `zoo.Transformer` on bytes: the Python standard library, or your text.

A byte-level causal language model (vocabulary 256), optax AdamW, a warmup +
cosine (or constant) learning-rate schedule. By default it reads the `.py`
sources of the standard library of the Python that runs it (sorted path order,
`site-packages` excluded); `--data PATH` reads a text file, or every text file
of a directory (hidden and binary ones skipped). The last `--val-fraction` of
the bytes is held out.

    python benchmarks/train_lm.py --steps 300 --save-dir runs/lm
    python benchmarks/train_lm.py --resume --save-dir runs/lm --remat recursive
    python benchmarks/train_lm.py --data my_texts/ --remat every:2:dots
    tensorboard --logdir runs/lm
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python benchmarks/train_lm.py --mesh fsdp:8 --batch 32 --device cpu

(`python -m benchmarks.train` is the same command.)

- Several processes (`--distributed`): only process 0 logs and writes; each
  reads only its rows of a batch. SIGTERM to any process stops every one after
  the same step, saved; a process that dies ends the others with one `error:`
  line and exit status 1.
- `--remat` changes memory and FLOPs, never the gradients, and may change
  between a run and its resumption.
- Checkpoints (`--save-dir`): the state's arrays (`eqx.partition(state,
  eqx.is_array)`) go to Orbax, sharded arrays per host into the same shardings;
  beside them a JSON item with the run's options and a SHA-256 of the arrays,
  checked by `--resume`, which skips a damaged newest checkpoint for the
  previous good one. SIGTERM or Ctrl-C: the step finishes, the state is saved,
  exit 0 (a second Ctrl-C aborts at once). Batches are a function of `--seed`
  and the step, a step's dropout key `fold_in(key, step)`: a resumed run is
  bit-identical to an uninterrupted one. With `--resume`, options that define
  the run default to the checkpoint's and must match it when given, except
  `--steps`, which may grow if the steps already taken keep their learning rates.
- Metrics, in the run directory: `metrics.jsonl`, one line per logged step
  (`step`, `loss`, `loss_avg` since the previous line, `eval_loss`, `lr`,
  `tokens_per_s` and `step_s` excluding compilation, `peak_bytes`, `mfu`, `hfu`,
  `wall_s`, `time`; `null` where the device cannot tell), the same scalars as
  TensorBoard events, and `loss.png`. MFU = FLOPs of the step with
  `checkpoint=None` (HFU: the run's checkpoint, recomputation included; causal
  attention counted in full, unlike MaxText) / (step time x the devices' peak
  bf16 FLOP/s).
"""

from .config import RunConfig as RunConfig, UsageError as UsageError
from .loop import TrainResult as TrainResult, main as main

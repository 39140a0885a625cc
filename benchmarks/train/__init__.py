"""Train `zoo.Transformer` on bytes: the Python standard library, or your text.

A byte-level causal language model (vocabulary 256) trained with optax AdamW and a
warmup + cosine (or constant) learning-rate schedule. By default it reads the `.py`
sources of the Python standard library that runs this script
(`sysconfig.get_paths()["stdlib"]`, in sorted path order, `site-packages`
excluded): real text that exists on every machine. `--data PATH` trains on a text
file, or on every text file of a directory (sorted path order; hidden files and
binary ones, with a NUL byte in their first 8 KiB, skipped), read as bytes. The
last `--val-fraction` of the bytes is held out for the evaluation loss.

    python benchmarks/train_lm.py --steps 300 --save-dir runs/lm
    python benchmarks/train_lm.py --resume --save-dir runs/lm --remat recursive
    python benchmarks/train_lm.py --data my_texts/ --remat every:2:dots
    tensorboard --logdir runs/lm
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python benchmarks/train_lm.py --mesh fsdp:8 --batch 32 --device cpu

(`python -m benchmarks.train` is the same command.)

- Where it runs: `--device auto` (default) takes the machine's TPU, else its GPU,
  else the CPU; an explicit `JAX_PLATFORMS` wins. On a TPU it computes in bfloat16
  by default (`--dtype`), elsewhere in float32 (bit-exact resumption on the CPU).
  `--mesh auto` (default) trains data parallel over all devices when there is more
  than one; `--mesh dp:N` / `fsdp:N` pick the strategy (FSDP splits each parameter
  and its Adam moments on their largest axis divisible by N; see `zoo.shard`).
  `--distributed` calls `jax.distributed.initialize()` for a multi-host slice: run
  the same command on every host; only process 0 logs and writes metrics, each
  process reads only its rows of a batch. Where JAX cannot find the processes
  itself (not a TPU slice, Slurm or Open MPI; or two processes on one machine),
  give `--coordinator-address HOST:PORT --num-processes N --process-id I` (or
  `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`). SIGTERM to
  any process stops every one after the same step, saved; a process that dies
  ends the others with one `error:` line and exit status 1.
- `--remat` picks how the stack of blocks is rematerialised (its `checkpoint`), in
  the syntax of every benchmark script (`benchmarks._common.parse_checkpoint`):
  `None`, a policy name (`dots`, `nothing`, ...; see `eqx_remat.POLICIES`),
  `every:4` or `every(4)`, `every:4:dots` or `every(4, dots)`, `nested:2`,
  `recursive`, `binomial:6`. It changes memory and FLOPs, never the gradients,
  and may change between a run and its resumption.
- `--save-dir DIR` is the run directory: Orbax checkpoints, kept the last `--keep`,
  one every `--save-every` steps, at the end, and when the run is stopped by
  SIGTERM or Ctrl-C (the current step finishes, the state is saved, one line says
  so, exit 0; a second Ctrl-C aborts at once). The state (model, optax state, step,
  dropout key) is split with `eqx.partition(state, eqx.is_array)`: the arrays go to
  Orbax as a pytree (sharded arrays are written and read per host, into the same
  shardings), the rest is rebuilt from the run's options. Beside the arrays each
  checkpoint holds a JSON item with the run's options and a SHA-256 of the arrays'
  contents taken at save time: `--resume` checks it, and a damaged newest
  checkpoint is reported in one line and skipped for the previous good one.
  Batches are a function of `--seed` and the step, the dropout key of a step is
  `fold_in(key, step)`: a resumed run is bit-identical to an uninterrupted one.
  With `--resume`, options that define the run default to the checkpoint's and
  must match it when given, except `--steps`, which may grow if the learning
  rates of the steps already taken stay the same (`--schedule constant`, or still
  in the warmup).
- Metrics go to the run directory (`--save-dir`, else a fresh
  `benchmarks/runs/train_lm-<date>/`, which holds no checkpoints):
  `metrics.jsonl`, one line per logged step (`step`, `loss` of that step,
  `loss_avg` since the previous line, `eval_loss` when computed, `lr`,
  `tokens_per_s` and `step_s` excluding compilation, `peak_bytes`, `mfu`, `hfu`,
  `wall_s`, `time`; `null` where the device cannot tell), the same scalars as
  TensorBoard event files (`loss/train`, `loss/held_out`, `optimizer/lr`,
  `speed/mfu`, ...; `tensorboard --logdir DIR`), and `loss.png` at the end. The
  console prints the logged loss and its average. MFU = the FLOPs of the step
  with `checkpoint=None` (HFU: with the run's checkpoint, recomputation included),
  counted by `eqx_remat.count_flops` with attention's full `seq x seq` score and
  context matmuls (no halving for the causal mask, unlike MaxText), / (step time x
  the devices' peak bf16 FLOP/s).
"""

from .config import RunConfig as RunConfig, UsageError as UsageError
from .loop import TrainResult as TrainResult, main as main

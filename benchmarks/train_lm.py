"""Train `zoo.Transformer` on the bytes of the Python standard library.

A byte-level causal language model (vocabulary 256) trained with optax AdamW and a
warmup + cosine (or constant) learning-rate schedule on the `.py` sources of the
Python standard library that runs this script (`sysconfig.get_paths()["stdlib"]`,
read in sorted path order, `site-packages` excluded): real text that exists on
every machine. The last `--val-fraction` of the bytes is held out for the
evaluation loss.

    python benchmarks/train_lm.py --steps 300 --ckpt-dir runs/lm
    python benchmarks/train_lm.py --resume --ckpt-dir runs/lm --checkpoint "recursive()"
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python benchmarks/train_lm.py --mesh fsdp:8 --batch 32 --device cpu

- Where it runs: `--device auto` (default) takes the machine's TPU, else its GPU,
  else the CPU; an explicit `JAX_PLATFORMS` wins. On a TPU it computes in bfloat16
  by default (`--dtype`), elsewhere in float32 (bit-exact resumption on the CPU).
  `--mesh auto` (default) trains data parallel over all devices when there is more
  than one; `--mesh dp:N` / `fsdp:N` pick the strategy (FSDP splits each parameter
  and its Adam moments on their largest axis divisible by N; see `zoo.shard`).
  `--distributed` calls `jax.distributed.initialize()` for a multi-host slice: run
  the same command on every host; only process 0 logs and writes metrics.
- `--checkpoint` picks how the stack of blocks is checkpointed, in the syntax of
  `run.py` (`benchmarks._common.parse_checkpoint`): `None`, a policy name (`dots`,
  `nothing`, ...; see `eqx_remat.POLICIES`), `every(4)`, `every(4, dots)`,
  `nested(2)`, `recursive()`, `binomial(6)`. It changes memory and FLOPs, never
  the gradients, and may change between a run and its resumption.
- Checkpoints (with `--ckpt-dir`) are Orbax checkpoints: a `CheckpointManager`
  keeps the last `--keep` of them, one every `--save-every` steps, at the end, and
  when the run is stopped by SIGTERM or Ctrl-C (the current step finishes, the
  state is saved, one line says so, exit 0; a second Ctrl-C aborts at once). The
  state (model, optax state, step, dropout key) is split with
  `eqx.partition(state, eqx.is_array)`: the arrays go to Orbax as a pytree
  (sharded arrays are written and read per host, into the same shardings), the
  rest (structure, static fields) is rebuilt from the run's options. Beside the
  arrays each checkpoint holds a JSON item with the run's options and a SHA-256 of
  the arrays' contents taken at save time: `--resume` checks it, and a damaged
  newest checkpoint is reported in one line and skipped for the previous good
  one. Batches are a function of `--seed` and the step, the dropout key of a step
  is `fold_in(key, step)`: a resumed run is bit-identical to an uninterrupted one.
  With `--resume`, options that define the run default to the checkpoint's and
  must match it when given, except `--steps`, which may grow if the learning
  rates of the steps already taken stay the same (`--schedule constant`, or still
  in the warmup).
- Metrics: `CKPT_DIR/metrics.jsonl`, one line per logged step (`step`, `loss` of
  that step, `loss_avg` since the previous line, `eval_loss` when computed, `lr`,
  `tokens_per_s` and `step_s` excluding compilation, `peak_bytes`, `mfu`, `hfu`,
  `wall_s`, `time`; `null` where the device cannot tell), and `CKPT_DIR/loss.png`
  at the end. MFU = the FLOPs of the step with `checkpoint=None` (HFU: with the
  run's checkpoint, recomputation included), counted by `eqx_remat.count_flops`
  with attention's full `seq x seq` score and context matmuls (no halving for the
  causal mask, unlike MaxText), / (step time x the devices' peak bf16 FLOP/s).
"""

import argparse
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

import eqx_remat
import zoo
from benchmarks import _device
from benchmarks._common import parse_checkpoint


VOCAB_SIZE = 256  # bytes
FORMAT = "eqx-remat/train_lm/2"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
log = logging.getLogger("train_lm")


# --------------------------------------------------------------------------- options


class UsageError(ValueError):
    """A bad command line or checkpoint: reported in one `error:` line, rc 2."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What defines a run: a resumed run must have the same values (`steps` may
    grow, see `check_extension`)."""

    seed: int = 0
    steps: int = 300
    batch: int = 16
    seq: int = 128
    d_model: int = 128
    heads: int = 4
    layers: int = 4
    d_ff: int | None = None
    dropout: float = 0.0
    dtype: str = "float32"
    lr: float = 3e-3
    schedule: str = "cosine"
    warmup: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    data_bytes: int | None = None
    val_fraction: float = 0.05


def _int_at_least(minimum: int):
    """An argparse `type`: an int >= `minimum`."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an int. Got {text!r}."
            ) from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}. Got {n}.")
        return n

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _float_in(low: float, high: float, *, closed_low: bool, name: str):
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number. Got {text!r}."
            ) from None
        ok = (low <= x if closed_low else low < x) and x < high
        if not ok or not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"must be in {name}. Got {x}.")
        return x

    return parse


_OLD_SPEC = re.compile(r"\s*(every|nested|binomial|recursive)((?::[^:]*)*)\s*$", re.I)


def checkpoint_spec(spec: str) -> str:
    """`--checkpoint`: checked with the parser shared by every script (the
    depth-dependent forms `every(sqrt)`, `binomial(log2)` are resolved later).
    The colon spelling of earlier versions (`every:4:dots`) is refused with the
    new one."""
    old = _OLD_SPEC.fullmatch(spec)
    if old and (":" in spec or "(" not in spec):
        name, rest = old.group(1).lower(), [a for a in old.group(2).split(":") if a]
        raise argparse.ArgumentTypeError(
            f"{spec!r} is the old spelling; write {name}({', '.join(rest)}) "
            "(the syntax of run.py, e.g. every(4), every(4, dots), recursive())."
        )
    try:
        parse_checkpoint(spec, depth=1)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"invalid checkpoint {spec!r}: {e}") from None
    return spec


def mesh_spec(spec: str) -> tuple[str, int | None] | None:
    """`--mesh`: `auto` (data parallel over all devices when there are several),
    `none`, `dp[:N]`, `fsdp[:N]` → `("auto"|"dp"|"fsdp", N or None)` or `None`."""
    head, _, count = spec.strip().lower().partition(":")
    if head == "none" and not count:
        return None
    if head == "auto" and not count:
        return ("auto", None)
    if head not in ("dp", "fsdp"):
        raise argparse.ArgumentTypeError(
            f"expected auto, none, dp[:DEVICES] or fsdp[:DEVICES]. Got {spec!r}."
        )
    return head, _positive_int(count) if count else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_lm.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = RunConfig()
    run = p.add_argument_group(
        "run definition (with --resume: default to the checkpoint's values)"
    )
    run.add_argument("--seed", type=int, help=f"init, data and dropout ({d.seed})")
    run.add_argument(
        "--steps", type=_positive_int, help=f"total optimiser steps ({d.steps})"
    )
    run.add_argument("--batch", type=_positive_int, help=f"sequences ({d.batch})")
    run.add_argument("--seq", type=_positive_int, help=f"tokens per row ({d.seq})")
    run.add_argument("--d-model", type=_positive_int, help=f"width ({d.d_model})")
    run.add_argument("--heads", type=_positive_int, help=f"attention heads ({d.heads})")
    run.add_argument("--layers", type=_positive_int, help=f"blocks ({d.layers})")
    run.add_argument("--d-ff", type=_positive_int, help="MLP hidden size (4 * d_model)")
    run.add_argument(
        "--dropout",
        type=_float_in(0.0, 1.0, closed_low=True, name="[0, 1)"),
        help=f"dropout rate, in [0, 1) ({d.dropout})",
    )
    run.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="compute dtype (bfloat16 on a TPU, else float32)",
    )
    run.add_argument(
        "--lr",
        type=_float_in(0.0, math.inf, closed_low=False, name="(0, inf)"),
        help=f"peak learning rate, > 0 ({d.lr})",
    )
    run.add_argument(
        "--schedule",
        choices=["cosine", "constant"],
        help="after the warmup: cosine decay to --min-lr-ratio * lr at --steps, "
        "or constant (a run that --resume can extend) (cosine)",
    )
    run.add_argument(
        "--warmup", type=_non_negative_int, help=f"linear warmup steps ({d.warmup})"
    )
    run.add_argument(
        "--min-lr-ratio",
        type=_float_in(0.0, math.inf, closed_low=True, name="[0, inf)"),
        help=f"final / peak learning rate of the cosine ({d.min_lr_ratio})",
    )
    run.add_argument(
        "--weight-decay",
        type=_float_in(0.0, math.inf, closed_low=True, name="[0, inf)"),
        help=f"AdamW decay of the linear weights ({d.weight_decay})",
    )
    run.add_argument(
        "--clip",
        type=_float_in(0.0, math.inf, closed_low=False, name="(0, inf)"),
        help=f"global gradient norm ({d.clip})",
    )
    run.add_argument(
        "--data-bytes", type=_positive_int, help="use only the first N corpus bytes"
    )
    run.add_argument(
        "--val-fraction",
        type=_float_in(0.0, 1.0, closed_low=False, name="(0, 1)"),
        help=f"held-out tail of the corpus ({d.val_fraction})",
    )
    p.add_argument(
        "--checkpoint",
        type=checkpoint_spec,
        default="dots",
        help="None, a policy name, every(K[, POLICY]), nested(L[, POLICY]), "
        "recursive(), binomial(S[, POLICY]) (default: %(default)s)",
    )
    p.add_argument(
        "--mesh",
        type=mesh_spec,
        default="auto",
        help="auto (dp over all devices if several), none, dp[:N] or fsdp[:N] "
        "(default: %(default)s)",
    )
    p.add_argument("--ckpt-dir", type=Path, help="checkpoints, metrics.jsonl, loss.png")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from CKPT_DIR's newest good checkpoint",
    )
    p.add_argument(
        "--save-every",
        type=_positive_int,
        default=100,
        help="save every N steps, and at the end (default: %(default)s)",
    )
    p.add_argument(
        "--keep",
        type=_positive_int,
        default=3,
        help="checkpoints kept: the newest N (default: %(default)s)",
    )
    p.add_argument(
        "--stop-after",
        type=_positive_int,
        default=None,
        help="stop (and save) after N steps of this invocation, as if preempted",
    )
    p.add_argument(
        "--log-every",
        type=_positive_int,
        default=25,
        help="log the loss every N steps (default: %(default)s)",
    )
    p.add_argument(
        "--eval-every",
        type=_non_negative_int,
        default=0,
        help="held-out loss every N steps (0: only at the end) (default: %(default)s)",
    )
    p.add_argument(
        "--eval-batches",
        type=_non_negative_int,
        default=8,
        help="batches of the held-out loss (0: none) (default: %(default)s)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _device.add_device_args(p)
    return p


def parse_args(
    argv: Sequence[str] | None, parser: argparse.ArgumentParser
) -> argparse.Namespace:
    """Parse and check every flag that can be checked before JAX starts."""
    args = parser.parse_args(argv)
    if args.resume and args.ckpt_dir is None:
        parser.error("argument --resume: needs --ckpt-dir.")
    if args.ckpt_dir is not None:
        try:
            args.ckpt_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=args.ckpt_dir):
                pass
        except OSError as e:
            parser.error(
                f"argument --ckpt-dir: {args.ckpt_dir} is not a writable "
                f"directory ({e.strerror or e})."
            )
        if (args.ckpt_dir / "checkpoint.eqx").exists() and args.resume:
            parser.error(
                f"argument --resume: {args.ckpt_dir} holds a checkpoint.eqx of an "
                "earlier version of this script, which this one does not read."
            )
    return args


def run_config(
    args: argparse.Namespace, saved: dict[str, Any] | None, platform: str
) -> RunConfig:
    """The run's `RunConfig`: the command line over the checkpoint's (`saved`) or
    the defaults. A value given on the command line must equal the saved one
    (except `steps`: see `check_extension`)."""
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(RunConfig)
        if getattr(args, f.name) is not None
    }
    if saved is None:
        if "dtype" not in given and platform == "tpu":
            given["dtype"] = "bfloat16"
        return RunConfig(**given)
    mismatched = [
        f"--{k.replace('_', '-')}: checkpoint has {saved[k]!r}, got {v!r}"
        for k, v in given.items()
        if saved[k] != v and k != "steps"
    ]
    if mismatched:
        raise UsageError(
            "--resume: these options define the run and differ from the "
            "checkpoint's (leave them out to use the checkpoint's): "
            + "; ".join(mismatched)
        )
    return dataclasses.replace(
        RunConfig(**saved), steps=given.get("steps", saved["steps"])
    )


def check_config(c: RunConfig) -> None:
    if c.d_model % c.heads != 0:
        raise UsageError(
            f"--d-model must be divisible by --heads. Got {c.d_model} and {c.heads}."
        )
    if not c.warmup < c.steps:
        raise UsageError(
            f"--warmup must be in [0, steps). Got {c.warmup} with {c.steps} steps."
        )


def check_extension(saved: RunConfig, c: RunConfig, at_step: int) -> None:
    """Resuming a run of `saved.steps` steps at `at_step` with `c.steps`: allowed
    when the learning rate of every step taken so far is the same under the new
    total, so the run is the one `--steps c.steps` would have made."""
    if c.steps == saved.steps:
        return
    if c.steps < at_step:
        raise UsageError(
            f"--steps {c.steps}: the checkpoint is at step {at_step} already."
        )
    taken = np.arange(at_step)
    with jax.numpy_dtype_promotion("standard"):
        old = np.asarray(learning_rate_schedule(saved)(taken))
        new = np.asarray(learning_rate_schedule(c)(taken))
    if not np.array_equal(old, new):
        changed = int(np.argmax(old != new))
        raise UsageError(
            f"--steps {c.steps}: the {c.schedule} learning-rate schedule of this "
            f"run depends on its length ({saved.steps} steps), and steps {changed} "
            f"to {at_step - 1} already taken would have had other learning rates. "
            f"Resume with --steps {saved.steps}, or start runs meant to be extended "
            "with --schedule constant."
        )


# ------------------------------------------------------------------------------ data


def stdlib_sources(root: Path) -> Iterator[Path]:
    """The `.py` files under `root`, in sorted path order, lazily; third-party
    packages (`site-packages`, `dist-packages`) and `__pycache__` are skipped."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    entries = sorted(os.scandir(root), key=lambda e: e.name)
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            if e.name not in skip:
                yield from stdlib_sources(Path(e.path))
        elif e.name.endswith(".py") and e.is_file():
            yield Path(e.path)


@functools.lru_cache(maxsize=4)
def load_corpus(max_bytes: int | None = None) -> tuple[np.ndarray, str]:
    """The standard library's `.py` sources as one `uint8` array (files joined in
    sorted order, at most `max_bytes`), and its SHA-256."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in stdlib_sources(root):
        data = path.read_bytes()
        if max_bytes is not None:
            data = data[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    raw = b"".join(chunks)
    corpus = np.frombuffer(raw, dtype=np.uint8)
    return corpus, hashlib.sha256(raw).hexdigest()


def sample(data: np.ndarray, seq: int, batch: int, seed: Sequence[int]) -> np.ndarray:
    """`batch` windows of `seq + 1` bytes at offsets drawn from `seed`: int32
    `(batch, seq + 1)`, inputs `[:, :-1]` and next-byte targets `[:, 1:]`."""
    starts = np.random.default_rng(list(seed)).integers(0, len(data) - seq, batch)
    return data[starts[:, None] + np.arange(seq + 1)].astype(np.int32)


# ----------------------------------------------------------------------------- model


class Placement(NamedTuple):
    """Where arrays live: a 1-D mesh with axis `"data"`, DP or FSDP."""

    mesh: Mesh
    fsdp: bool

    def params(self, tree):
        return zoo.shard(tree, self.mesh, fsdp=self.fsdp)

    def batch(self, tree):
        return zoo.shard_batch(tree, self.mesh)


class TrainState(NamedTuple):
    """Everything a resumed run needs besides the `RunConfig`."""

    model: zoo.Transformer
    opt_state: Any
    step: jax.Array  # int32 scalar: optimiser steps taken
    key: jax.Array  # uint32 key data; the dropout key of step s is fold_in(key, s)


def make_model(c: RunConfig, key) -> zoo.Transformer:
    return zoo.Transformer(
        VOCAB_SIZE,
        c.seq,
        c.d_model,
        c.heads,
        c.layers,
        d_ff=c.d_ff,
        dropout=c.dropout,
        dtype=jnp.dtype(c.dtype),
        key=key,
    )


def decay_mask(params):
    """AdamW decays the weights of linear layers only (not embeddings, norms or
    biases)."""

    def mark(x):
        if isinstance(x, zoo.Dense):
            m = jax.tree.map(lambda _: False, x)
            return eqx.tree_at(lambda lin: lin.weight, m, True)
        return False

    is_linear = lambda x: isinstance(x, zoo.Dense)
    return jax.tree.map(mark, params, is_leaf=is_linear)


def learning_rate_schedule(c: RunConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup` steps, then either a cosine decay
    to `lr * min_lr_ratio` at step `steps` or a constant `lr`."""
    if c.schedule == "constant":
        if c.warmup == 0:
            return optax.constant_schedule(c.lr)
        return optax.warmup_constant_schedule(0.0, c.lr, c.warmup)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=c.lr,
        warmup_steps=c.warmup,
        decay_steps=c.steps,
        end_value=c.lr * c.min_lr_ratio,
    )


@functools.lru_cache(maxsize=8)
def make_optimizer(c: RunConfig) -> optax.GradientTransformation:
    """Clipping, then AdamW on the learning-rate schedule. (Cached: an equal
    config gives the same optimiser, so the compiled step is reused.)"""
    return optax.chain(
        optax.clip_by_global_norm(c.clip),
        optax.adamw(
            learning_rate_schedule(c),
            b1=0.9,
            b2=0.95,
            weight_decay=c.weight_decay,
            mask=decay_mask,
        ),
    )


@eqx.filter_jit
def init_state(c: RunConfig) -> TrainState:
    """A fresh `TrainState` from `c.seed` (jitted: one compile, not one per op)."""
    model_key, dropout_key = jr.split(jr.key(c.seed))
    model = make_model(c, model_key)
    opt_state = make_optimizer(c).init(eqx.filter(model, eqx.is_array))
    return TrainState(model, opt_state, jnp.int32(0), jr.key_data(dropout_key))


def loss_fn(model: zoo.Transformer, tokens: jax.Array, key: jax.Array | None):
    """Mean next-byte cross-entropy (nats) of `tokens`, `(batch, seq + 1)`."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if key is None:
        logits = jax.vmap(model)(inputs)
    else:
        keys = jr.split(key, tokens.shape[0])
        logits = jax.vmap(lambda t, k: model(t, key=k))(inputs, keys)
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets
    )
    return jnp.mean(losses)


def step_fn(
    tokens_and_step: tuple[jax.Array, jax.Array],
    state: TrainState,
    optimizer: optax.GradientTransformation,
    placement: Placement | None,
) -> tuple[jax.Array, TrainState]:
    """One AdamW step on `tokens`; returns the loss before the step."""
    tokens, step = tokens_and_step
    key = jr.fold_in(jr.wrap_key_data(state.key), step)
    loss, grads = eqx.filter_value_and_grad(loss_fn)(state.model, tokens, key)
    params = eqx.filter(state.model, eqx.is_array)
    # optax computes `b1 ** count` (a Python float to an int32 power): allowed under
    # the standard dtype promotion, refused by the strict one that the tests use.
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
    model = eqx.apply_updates(state.model, updates)
    state = TrainState(model, opt_state, state.step + 1, state.key)
    if placement is not None:  # keep the parameters (and moments) where they were
        state = placement.params(state)
    return loss, state


train_step = eqx.filter_jit(step_fn, donate="all-except-first")


@eqx.filter_jit
def eval_loss(model: zoo.Transformer, tokens: jax.Array) -> jax.Array:
    return loss_fn(eqx.nn.inference_mode(model), tokens, None)


def step_flops(
    state: TrainState, tokens: Any, optimizer: optax.GradientTransformation
) -> tuple[int, int]:
    """FLOPs of one training step on the global batch `tokens` (an array or a
    `jax.ShapeDtypeStruct`): `(model, hardware)`, i.e. with `checkpoint=None` (no
    recomputation, for MFU) and with the state's own checkpoint (for HFU). Counted
    by `eqx_remat.count_flops` from the traced step; attention's score and context
    matmuls count in full (`seq x seq`), without halving for the causal mask."""

    def count(s: TrainState) -> int:
        arrays, static = eqx.partition(s, eqx.is_array)
        fn = lambda a, t: step_fn(
            (t, jnp.int32(0)), eqx.combine(a, static), optimizer, None
        )
        return int(eqx_remat.count_flops(fn, arrays, tokens))

    hardware = count(state)
    model = count(eqx_remat.set_checkpoint(state, None))
    return model, hardware


# ------------------------------------------------------------------------ checkpoints
#
# An Orbax checkpoint of step N is the directory CKPT_DIR/N with two items:
# `state`, the arrays of `eqx.partition(state, eqx.is_array)` as an Orbax pytree
# (each host writes the shards it owns; Orbax's own metadata describes every array)
# and `meta`, a JSON object with the run's options and `sha256`: the SHA-256 of
# the arrays' bytes per process, taken at save time. Restoring fills a pytree of
# `jax.ShapeDtypeStruct`s that carry the shardings of this run, then recomputes
# the hashes: a checkpoint that cannot be read, or reads back different bytes, is
# damaged and never used.


class Damaged(Exception):
    """A checkpoint that cannot be read or does not match its content hash."""


def content_sha256(arrays: Any) -> str:
    """SHA-256 of the bytes this process holds of every array of `arrays`, with
    their pytree paths: a whole array when this process can see all of it (one
    host, any mesh), else its shards of replica 0 with their index (the shards
    this host writes; the same again after restoring into the same shardings)."""
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_leaves_with_path(arrays):
        h.update(jax.tree_util.keystr(path).encode())
        if x.is_fully_addressable:
            h.update(np.ascontiguousarray(jax.device_get(x)).tobytes())
            continue
        shards = [s for s in x.addressable_shards if s.replica_id == 0]
        for s in sorted(shards, key=lambda s: repr(s.index)):
            h.update(repr(s.index).encode())
            h.update(np.ascontiguousarray(jax.device_get(s.data)).tobytes())
    return h.hexdigest()


def all_processes(digest: str) -> list[str]:
    """Every process's `digest`, in process order (one collective)."""
    if jax.process_count() == 1:
        return [digest]
    mine = np.frombuffer(bytes.fromhex(digest), dtype=np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(mine))
    return [bytes(row).hex() for row in gathered.reshape(jax.process_count(), -1)]


def open_manager(ckpt_dir: Path, keep: int) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        enable_async_checkpointing=True,
        create=True,
        # Not `cleanup_tmp_directories`: it runs in a thread that close() does not
        # join, and fails at exit. The unfinished save of a second Ctrl-C is
        # ignored by Orbax, and replaced when that step is saved again.
    )
    return ocp.CheckpointManager(ckpt_dir.absolute(), options=options)


def save_checkpoint(
    mgr: ocp.CheckpointManager, step: int, state: TrainState, meta: dict[str, Any]
) -> None:
    """Start saving `state` as step `step` (asynchronously: Orbax copies the arrays
    to the host, then writes them in the background)."""
    arrays = eqx.filter(state, eqx.is_array)
    meta = {**meta, "step": step, "sha256": all_processes(content_sha256(arrays))}
    mgr.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
        ),
        force=True,
    )


def read_meta(mgr: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    try:
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = meta["meta"]
    except Exception as e:
        raise Damaged(_one_line(e)) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise Damaged(f"expected a JSON item of format {FORMAT!r}")
    missing = {"config", "corpus_sha256", "sha256"} - set(meta)
    if missing:
        raise Damaged(f"its JSON item lacks {', '.join(sorted(missing))}")
    try:
        RunConfig(**meta["config"])
    except TypeError as e:
        raise Damaged(f"its JSON item has other run options: {e}") from None
    return meta


def restore_state(
    mgr: ocp.CheckpointManager, step: int, like: TrainState, meta: dict[str, Any]
) -> TrainState:
    """The `TrainState` of step `step`, into the shapes, dtypes and shardings of
    `like` (`jax.ShapeDtypeStruct`s), checked against its content hash."""
    is_struct = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    arrays, static = eqx.partition(like, is_struct)
    try:
        restored = mgr.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(arrays))
        )["state"]
        for a, b in zip(
            jax.tree.leaves(restored), jax.tree.leaves(arrays), strict=True
        ):
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                raise Damaged(
                    f"expected an array {b.dtype}{list(b.shape)}. "
                    f"Got {a.dtype}{list(a.shape)}"
                )
    except Damaged:
        raise
    except Exception as e:
        raise Damaged(_one_line(e)) from None
    expected = meta.get("sha256")
    if not isinstance(expected, list) or len(expected) != jax.process_count():
        raise Damaged(
            f"its content hash is missing or for another process count "
            f"({jax.process_count()} processes now)"
        )
    ok = content_sha256(restored) == expected[jax.process_index()]
    if jax.process_count() > 1:  # every host falls back together
        ok = bool(np.all(multihost_utils.process_allgather(np.int32(ok))))
    if not ok:
        raise Damaged("its arrays do not match the SHA-256 recorded when it was saved")
    return eqx.combine(restored, static)


def _in_orbax(code: Any) -> bool:
    return f"{os.sep}orbax{os.sep}" in getattr(code, "co_filename", "")


def _from_orbax(e: BaseException | None) -> bool:
    """Whether `e`, or an exception it was raised from, passed through Orbax."""
    while e is not None:
        tb = e.__traceback__
        while tb is not None:
            if _in_orbax(tb.tb_frame.f_code):
                return True
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return False


def ignore_abandoned_reads() -> None:
    """Called once a checkpoint was found damaged. When one read of it failed,
    Orbax gave up the restore and closed its event loop while its other reads were
    in flight; when they finish or are garbage-collected, Python reports them to
    `sys.unraisablehook` (Orbax's coroutines closed mid-read, `RuntimeError:
    Event loop is closed`) or to the `asyncio` logger ("Task/Future exception was
    never retrieved"): stray tracebacks after the one-line report. Drop those;
    other unraisable exceptions go to the previous hook. (The script itself
    does not use asyncio; Orbax reports failed saves through its own futures.)"""
    logging.getLogger("asyncio").disabled = True
    previous = sys.unraisablehook
    if getattr(previous, "train_lm", False):
        return

    def hook(unraisable: Any) -> None:
        e = unraisable.exc_value
        closed_loop = isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
        if (
            _in_orbax(getattr(unraisable.object, "cr_code", None))
            or _from_orbax(e)
            or closed_loop
        ):
            return
        previous(unraisable)

    hook.train_lm = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _one_line(e: BaseException) -> str:
    text = (str(e) or type(e).__name__).strip().splitlines()[0]
    text = text.split(" See full TensorStore details")[0]  # a repr of a method
    return f"{type(e).__name__}: {text[:200]}"


def set_aside(ckpt_dir: Path, step: int) -> None:
    """Move a damaged checkpoint out of the manager's way (Orbax ignores a
    directory whose name is not a step), so the resumed run can save that step
    again; its bytes stay for inspection."""
    if _device.is_main_process():
        target = ckpt_dir / f"damaged-{step}"
        if target.exists():
            shutil.rmtree(target)
        (ckpt_dir / str(step)).rename(target)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("train_lm: set aside")


# ------------------------------------------------------------------- signals, metrics


class StopRequest:
    """SIGTERM / SIGINT: the first asks the loop to finish its step, save and exit
    0; the handler then gives the signal back to the operating system, so a second
    one ends the process at once (even inside a compile), without saving."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}

    def install(self) -> None:
        signals = [signal.SIGINT]
        if jax.process_count() == 1:
            # On a multi-host slice, SIGTERM (preemption) reaches JAX's preemption
            # notifier, and the hosts agree on a step (`reached_preemption_sync_point`).
            signals.append(signal.SIGTERM)
        for s in signals:
            self.previous[s] = signal.signal(s, self._handle)

    def uninstall(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        for s in self.previous:
            signal.signal(s, signal.SIG_DFL)

    def requested(self, step: int) -> bool:
        if self.signum is not None or jax.process_count() == 1:
            return self.signum is not None
        return multihost_utils.reached_preemption_sync_point(step)


class _StderrHandler(logging.StreamHandler):
    """Writes to the `sys.stderr` of the moment, so that rich's live progress bar,
    which redirects it, prints log lines above the bar."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            return f"{record.levelname.lower()}: {text}"
        return text


def setup_logging() -> None:
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(_Formatter())
        log.addHandler(handler)
    log.propagate = False
    # Only process 0 of a multi-host run speaks (errors excepted).
    log.setLevel(logging.INFO if _device.is_main_process() else logging.ERROR)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    return rows


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the lines of steps up to `step` (a resumed run writes the rest again)."""
    rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def plot_losses(metrics: Path, out: Path) -> None:
    """The loss curve of `metrics` (training loss, held-out loss) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics)
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    ax.plot([r["step"] for r in rows], [r["loss_avg"] for r in rows], label="train")
    evals = [r for r in rows if r.get("eval_loss") is not None]
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_loss"] for r in evals],
            "o-",
            label="held out",
        )
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title="train_lm.py")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------ main


class TrainResult(NamedTuple):
    """What `main` returns (for tests and notebooks)."""

    state: TrainState
    losses: list[float]  # the training loss of each step of this invocation
    first_step: int  # the step number of `losses[0]`
    eval_loss: float | None  # the final held-out loss, if computed
    stopped: bool  # by a signal or --stop-after, before --steps


def make_placement(spec: tuple[str, int | None] | None, batch: int) -> Placement | None:
    if spec is None:
        return None
    strategy, n = spec
    available = jax.device_count()
    if strategy == "auto":
        if available == 1:
            return None
        strategy, n = "dp", available
    n = available if n is None else n
    if n > available:
        raise UsageError(
            f"--mesh {strategy}:{n}: expected 1 to {available} devices (jax sees "
            f"{available}). On CPU, set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={n} before starting Python."
        )
    if batch % n != 0:
        raise UsageError(
            f"--mesh {strategy}:{n}: --batch must be divisible by {n} devices. "
            f"Got {batch}."
        )
    mesh = jax.make_mesh((n,), ("data",), (AxisType.Auto,), devices=jax.devices()[:n])
    return Placement(mesh, fsdp=strategy == "fsdp")


def find_resume_point(
    mgr: ocp.CheckpointManager, ckpt_dir: Path, like_for
) -> tuple[int, dict[str, Any], TrainState]:
    """The newest checkpoint that reads back intact: `(step, meta, state)`.
    `like_for(meta)` gives the abstract state to restore into. Damaged ones are
    reported in one line each and set aside."""
    steps = sorted(mgr.all_steps(), reverse=True)
    if not steps:
        raise UsageError(f"--resume: no checkpoint in {ckpt_dir}.")
    damaged: list[tuple[int, str]] = []
    for step in steps:
        try:
            meta = read_meta(mgr, step)
            state = restore_state(mgr, step, like_for(meta), meta)
        except Damaged as e:
            ignore_abandoned_reads()
            damaged.append((step, str(e)))
            older = [s for s in steps if s < step]
            then = f"falling back to step {older[0]}" if older else "no older one"
            log.warning(f"checkpoint {ckpt_dir / str(step)} is damaged ({e}); {then}")
            continue
        for bad, _ in damaged:
            set_aside(ckpt_dir, bad)
        if damaged:
            mgr.reload()
        return step, meta, state
    raise UsageError(
        f"--resume: no intact checkpoint in {ckpt_dir} (steps "
        f"{', '.join(str(s) for s, _ in damaged)} are all damaged)."
    )


def main(argv: Sequence[str] | None = None) -> TrainResult:
    parser = build_parser()
    args = parse_args(argv, parser)
    platform = _device.select_device(args, parser)
    setup_logging()
    main_process = _device.is_main_process()
    mgr = open_manager(args.ckpt_dir, args.keep) if args.ckpt_dir else None
    stop = StopRequest()
    stop.install()  # a signal before the first step stops the run after it
    try:
        return _train(args, platform, mgr, stop, main_process)
    finally:
        stop.uninstall()
        if mgr is not None:
            mgr.wait_until_finished()
            mgr.close()


def _train(args, platform, mgr, stop, main_process) -> TrainResult:
    started = time.perf_counter()
    ckpt_dir = args.ckpt_dir
    if mgr is not None and not args.resume and mgr.all_steps():
        raise UsageError(
            f"--ckpt-dir {ckpt_dir} already holds checkpoints (steps "
            f"{', '.join(map(str, mgr.all_steps()))}): add --resume to continue "
            "that run, or pick another directory."
        )

    placement: Placement | None = None
    checkpoint: eqx_remat.Checkpoint = None

    def like_for(meta: dict[str, Any]) -> TrainState:
        """Abstract state of the run `meta` describes, with this run's shardings."""
        c = RunConfig(**meta["config"])
        like = eqx_remat.set_checkpoint(eqx.filter_eval_shape(init_state, c), None)
        return placement.params(like) if placement is not None else like

    saved_meta = None
    if args.resume:
        # The run's options come from the newest checkpoint's JSON, before any
        # array is restored, so the placement can be made first.
        for step in sorted(mgr.all_steps(), reverse=True):
            try:
                saved_meta = read_meta(mgr, step)
                break
            except Damaged:
                continue  # reported by find_resume_point
    c = run_config(args, saved_meta and saved_meta["config"], platform)
    check_config(c)
    checkpoint = parse_checkpoint(args.checkpoint, depth=c.layers)
    placement = make_placement(args.mesh, c.batch)

    corpus, digest = load_corpus(c.data_bytes)
    split = len(corpus) - int(len(corpus) * c.val_fraction)
    train, val = corpus[:split], corpus[split:]
    if min(len(train), len(val)) <= c.seq:
        raise UsageError(
            f"The corpus ({len(corpus)} bytes, {len(val)} held out) is too small "
            f"for --seq {c.seq}: raise --data-bytes or --val-fraction."
        )

    metrics_path = ckpt_dir / METRICS_FILE if ckpt_dir else None
    if args.resume:
        if mgr is not None and not mgr.all_steps():
            raise UsageError(f"--resume: no checkpoint in {ckpt_dir}.")
        step0, meta, state = find_resume_point(mgr, ckpt_dir, like_for)
        saved_c = RunConfig(**meta["config"])
        c = run_config(args, meta["config"], platform)
        check_config(c)
        check_extension(saved_c, c, step0)
        if meta["corpus_sha256"] != digest:
            raise UsageError(
                f"--resume: the corpus differs from the checkpoint's (another "
                f"Python's standard library?): sha256 {digest[:12]} != "
                f"{meta['corpus_sha256'][:12]}. Batches would not match."
            )
        if main_process and metrics_path is not None:
            truncate_metrics(metrics_path, step0)
    else:
        if main_process and metrics_path is not None:
            truncate_metrics(metrics_path, 0)  # of a run that never saved
        state = init_state(c)
        if placement is not None:
            state = placement.params(state)
    # `checkpoint` is not part of the run: it changes memory and FLOPs only. It is a
    # static field, so it is also in the treedef of the Adam moments (pytrees shaped
    # like the model): replace it in the whole state, not just in the model.
    state = eqx_remat.set_checkpoint(state, checkpoint)
    optimizer = make_optimizer(c)

    def learning_rate(step: int) -> float:
        with jax.numpy_dtype_promotion("standard"):
            return float(learning_rate_schedule(c)(step))

    first = int(state.step)
    last = c.steps if args.stop_after is None else min(c.steps, first + args.stop_after)
    n_devices = 1 if placement is None else placement.mesh.size
    peak_flops = _device.peak_flops_per_chip()
    flops = (None, None)
    if peak_flops is not None:  # MFU is null where the peak is unknown (the CPU)
        tokens_like = jax.ShapeDtypeStruct((c.batch, c.seq + 1), jnp.int32)
        flops = step_flops(state, tokens_like, optimizer)

    params = sum(x.size for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array)))
    log.info(
        f"zoo.Transformer: {params:,} parameters, d_model {c.d_model}, {c.layers} "
        f"layers, {c.heads} heads, seq {c.seq}, batch {c.batch}, {c.dtype}; "
        f"checkpoint={checkpoint!r}; {_device.device_kind()} x{n_devices} "
        f"({'none' if placement is None else 'fsdp' if placement.fsdp else 'dp'}); "
        f"corpus {len(train):,} + {len(val):,} held-out bytes; "
        f"steps {first} -> {last} of {c.steps}"
    )

    meta_base = {
        "format": FORMAT,
        "config": dataclasses.asdict(c),
        "corpus_sha256": digest,
        "checkpoint": repr(checkpoint),
    }

    def held_out_loss(model) -> float:
        total = 0.0
        for i in range(args.eval_batches):
            tokens = sample(val, c.seq, c.batch, (c.seed, 1, i))
            if placement is not None:
                tokens = placement.batch(tokens)
            total += float(eval_loss(model, tokens))
        return total / args.eval_batches

    metrics = (
        open(metrics_path, "a") if main_process and metrics_path is not None else None
    )
    losses: list[jax.Array] = []
    final_eval: float | None = None
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("loss {task.fields[loss]}"),
    )
    console = Console()
    # Timing windows: steps completed since `window_start`, of which `timed` ran
    # after compilation, in `window_s` seconds (evaluation and saving excluded).
    window_start, timed, window_s, tick = first, 0, 0.0, time.perf_counter()
    compiled = False
    stopped_by: str | None = None
    done = first
    progress = Progress(
        *columns,
        console=console,
        disable=args.no_progress or not main_process,
    )
    try:
        with progress:
            task = progress.add_task(
                "compiling", total=c.steps, completed=first, loss="-"
            )
            for step in range(first, last):
                tokens = sample(train, c.seq, c.batch, (c.seed, 0, step))
                if placement is not None:
                    tokens = placement.batch(tokens)
                loss, state = train_step(
                    (tokens, jnp.int32(step)), state, optimizer, placement
                )
                losses.append(loss)
                done = step + 1
                if not compiled:  # the first step of an invocation compiles
                    jax.block_until_ready(loss)
                    compiled = True
                    progress.update(task, description="train")
                    tick = time.perf_counter()
                else:
                    timed += 1
                stopping = stop.requested(done)
                logging_due = (
                    done % args.log_every == 0
                    or done == last
                    or (args.eval_every and done % args.eval_every == 0)
                )
                save_due = mgr is not None and (
                    done % args.save_every == 0 or done == last or stopping
                )
                if logging_due or save_due:  # stop the clock: eval and saving
                    jax.block_until_ready((loss, state))  # do not count
                    window_s += time.perf_counter() - tick
                if logging_due:
                    eval_due = args.eval_batches and (
                        done == c.steps
                        or (args.eval_every and done % args.eval_every == 0)
                    )
                    evaluated = held_out_loss(state.model) if eval_due else None
                    if done == c.steps:
                        final_eval = evaluated
                    window = [float(x) for x in losses[window_start - first :]]
                    step_s = window_s / timed if timed else None
                    row = {
                        "step": done,
                        "loss": window[-1],
                        "loss_avg": sum(window) / len(window),
                        "eval_loss": evaluated,
                        "lr": learning_rate(step),
                        "tokens_per_s": c.batch * c.seq / step_s if step_s else None,
                        "step_s": step_s,
                        "peak_bytes": _device.peak_bytes_in_use(),
                        "mfu": _mfu(flops[0], step_s, peak_flops, n_devices),
                        "hfu": _mfu(flops[1], step_s, peak_flops, n_devices),
                        "wall_s": round(time.perf_counter() - started, 3),
                        "time": time.time(),
                    }
                    if metrics is not None:
                        metrics.write(json.dumps(row) + "\n")
                        metrics.flush()
                    log.info(_log_line(row))
                    progress.update(task, loss=f"{row['loss_avg']:.4f}")
                    window_start, timed, window_s = done, 0, 0.0
                if save_due:
                    save_checkpoint(mgr, done, state, meta_base)
                if logging_due or save_due:
                    tick = time.perf_counter()
                progress.update(task, completed=done)
                if stopping:
                    stopped_by = (
                        signal.Signals(stop.signum).name
                        if stop.signum
                        else "preemption"
                    )
                    break
    finally:
        if metrics is not None:
            metrics.close()

    if mgr is not None:
        mgr.wait_until_finished()
    where = (
        f"saved step {done} to {ckpt_dir}"
        if mgr is not None
        else "nothing saved (no --ckpt-dir)"
    )
    if stopped_by is not None:
        log.info(
            f"{stopped_by}: stopped after step {done} of {c.steps}; {where}"
            + (f"; continue with --resume --ckpt-dir {ckpt_dir}" if mgr else "")
        )
    else:
        log.info(f"step {done} of {c.steps}: {where}")
    if final_eval is not None:
        log.info(
            f"held-out loss {final_eval:.4f} "
            f"({final_eval / math.log(2):.3f} bits/byte) after {done} steps"
        )
    if main_process and metrics_path is not None and metrics_path.exists():
        plot_losses(metrics_path, ckpt_dir / PLOT_FILE)
    return TrainResult(
        state, [float(x) for x in losses], first, final_eval, done < c.steps
    )


def _mfu(flops, step_s, peak_flops, n_devices) -> float | None:
    if flops is None or not step_s or peak_flops is None:
        return None
    return flops / (step_s * peak_flops * n_devices)


def _log_line(row: dict[str, Any]) -> str:
    parts = [
        f"step {row['step']:>6}",
        f"loss {row['loss_avg']:.4f} ({row['loss_avg'] / math.log(2):.3f} bits/byte)",
    ]
    if row["eval_loss"] is not None:
        parts.append(f"held-out {row['eval_loss']:.4f}")
    parts.append(f"lr {row['lr']:.2e}")
    parts.append(
        "tokens/s n/a (the first step compiled)"
        if row["tokens_per_s"] is None
        else f"{row['tokens_per_s']:,.0f} tokens/s"
    )
    if row["mfu"] is not None:
        parts.append(f"MFU {row['mfu']:.1%} (HFU {row['hfu']:.1%})")
    if row["peak_bytes"] is not None:
        parts.append(f"peak {row['peak_bytes'] / 2**30:.2f} GiB")
    return "  ".join(parts)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UsageError as e:
        print(f"train_lm.py: error: {e}", file=sys.stderr)
        sys.exit(2)

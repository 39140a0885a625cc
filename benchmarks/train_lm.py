"""Train `zoo.Transformer` on the bytes of the Python standard library.

A byte-level causal language model (vocabulary 256) trained with optax AdamW and a
warmup + cosine learning-rate schedule on the `.py` sources of the Python standard
library that runs this script (`sysconfig.get_paths()["stdlib"]`, read in sorted
path order, `site-packages` excluded): real text that exists on every machine. The
last `--val-fraction` of the bytes is held out for the evaluation loss.

    python benchmarks/train_lm.py --steps 300 --ckpt-dir runs/lm
    python benchmarks/train_lm.py --resume --ckpt-dir runs/lm --steps 300 \\
        --checkpoint recursive
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python benchmarks/train_lm.py --mesh fsdp:8 --batch 32

- `--checkpoint` picks how the stack of blocks is checkpointed: `none`, a policy
  name (`dots`, `nothing`, ...; see `eqx_remat.POLICIES`), or a schedule
  `every:K`, `nested:LEVELS`, `binomial:SLOTS` (each optionally with an inner
  policy after a colon: `every:2:dots`) or `recursive`. It changes
  memory and FLOPs, never the gradients: the losses agree to float tolerance, and
  it may change between a run and its resumption.
- Batches are a deterministic function of `--seed` and the step number, and the
  dropout key of a step is `fold_in(key, step)`: a checkpoint (model, optimiser
  state, step and key, written atomically to `CKPT_DIR/checkpoint.eqx` with
  `eqx.tree_serialise_leaves` behind a JSON header line) resumes to the
  bit-identical parameters of an uninterrupted run. With `--resume`, options that
  define the run (model size, optimiser, data, `--steps`, ...) default to the
  checkpoint's values and must match them when given.
- `--mesh dp:N` trains data parallel on N devices (parameters replicated, batch
  split), `--mesh fsdp:N` fully sharded (each parameter and its Adam moments split
  on their largest axis divisible by N) — see `zoo.shard`. On CPU, make N devices
  with `XLA_FLAGS=--xla_force_host_platform_device_count=N`.
"""

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import (  # noqa: E402
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

import eqx_remat  # noqa: E402
import zoo  # noqa: E402


VOCAB_SIZE = 256  # bytes
CHECKPOINT_FILE = "checkpoint.eqx"
FORMAT = "eqx-remat/train_lm/1"


# --------------------------------------------------------------------------- options


class UsageError(ValueError):
    """A bad command line or checkpoint: reported without a traceback."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What defines a run: a resumed run must have the same values."""

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
    warmup: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    data_bytes: int | None = None
    val_fraction: float = 0.05


def parse_checkpoint(spec: str) -> eqx_remat.Checkpoint:
    """`--checkpoint` → a `checkpoint` value for the model.

    `none`; a policy name; `every:K`, `nested:LEVELS` or `binomial:SLOTS`, each
    optionally followed by `:POLICY`; `recursive`.
    """
    forms = (
        "none, a policy name ("
        + ", ".join(eqx_remat.POLICIES)
        + "), every:K, nested:LEVELS, binomial:SLOTS (optionally followed by "
        ":POLICY, e.g. every:2:dots) or recursive"
    )
    head, *rest = spec.strip().lower().split(":")
    try:
        if head == "none" and not rest:
            return None
        if head in eqx_remat.POLICIES and not rest:
            return head
        if head == "recursive" and len(rest) <= 1:
            return eqx_remat.recursive(policy=rest[0] if rest else None)
        makers = {
            "every": eqx_remat.every,
            "nested": eqx_remat.nested,
            "binomial": eqx_remat.binomial,
        }
        if head in makers and 1 <= len(rest) <= 2:
            policy = rest[1] if len(rest) == 2 else None
            return makers[head](int(rest[0]), policy=policy)
    except ValueError as e:
        raise UsageError(f"Invalid --checkpoint {spec!r}: {e}") from None
    raise UsageError(f"Invalid --checkpoint {spec!r}. Expected one of: {forms}.")


def parse_mesh(spec: str) -> tuple[str, int] | None:
    """`--mesh` → `None` or `(strategy, devices)`: `none`, `dp[:N]`, `fsdp[:N]`."""
    head, _, count = spec.strip().lower().partition(":")
    if head == "none" and not count:
        return None
    if head not in ("dp", "fsdp"):
        raise UsageError(
            f"Invalid --mesh {spec!r}. Expected none, dp[:DEVICES] or fsdp[:DEVICES]."
        )
    available = jax.device_count()
    try:
        n = int(count) if count else available
    except ValueError:
        raise UsageError(f"Invalid --mesh {spec!r}: {count!r} is not an int.") from None
    if not 1 <= n <= available:
        raise UsageError(
            f"--mesh {spec}: expected 1 to {available} devices (jax sees "
            f"{available}). Got {n}. On CPU, set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={n} before starting Python."
        )
    return head, n


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = RunConfig()
    run = p.add_argument_group(
        "run definition (with --resume: default to the checkpoint's values)"
    )
    run.add_argument("--seed", type=int, help=f"init, data and dropout ({d.seed})")
    run.add_argument("--steps", type=int, help=f"total optimiser steps ({d.steps})")
    run.add_argument("--batch", type=int, help=f"sequences per step ({d.batch})")
    run.add_argument("--seq", type=int, help=f"tokens per sequence ({d.seq})")
    run.add_argument("--d-model", type=int, help=f"model width ({d.d_model})")
    run.add_argument("--heads", type=int, help=f"attention heads ({d.heads})")
    run.add_argument("--layers", type=int, help=f"decoder blocks ({d.layers})")
    run.add_argument("--d-ff", type=int, help="MLP hidden size (4 * d_model)")
    run.add_argument("--dropout", type=float, help=f"dropout rate ({d.dropout})")
    run.add_argument(
        "--dtype", choices=["float32", "bfloat16"], help=f"compute dtype ({d.dtype})"
    )
    run.add_argument("--lr", type=float, help=f"peak learning rate ({d.lr})")
    run.add_argument("--warmup", type=int, help=f"linear warmup steps ({d.warmup})")
    run.add_argument(
        "--min-lr-ratio",
        type=float,
        help=f"final / peak learning rate of the cosine ({d.min_lr_ratio})",
    )
    run.add_argument(
        "--weight-decay",
        type=float,
        help=f"AdamW decay of the linear weights ({d.weight_decay})",
    )
    run.add_argument("--clip", type=float, help=f"global gradient norm ({d.clip})")
    run.add_argument(
        "--data-bytes", type=int, help="use only the first N bytes of the corpus"
    )
    run.add_argument(
        "--val-fraction",
        type=float,
        help=f"held-out tail of the corpus ({d.val_fraction})",
    )
    p.add_argument(
        "--checkpoint",
        default="dots",
        help="none, a policy name, every:K, nested:L, binomial:S (optionally "
        ":POLICY), or recursive (dots)",
    )
    p.add_argument("--mesh", default="none", help="none, dp[:N] or fsdp[:N] (none)")
    p.add_argument("--ckpt-dir", type=Path, help="where checkpoint.eqx is written")
    p.add_argument(
        "--resume", action="store_true", help="continue from CKPT_DIR/checkpoint.eqx"
    )
    p.add_argument(
        "--save-every", type=int, default=0, help="also save every N steps (0: at end)"
    )
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop (and save) after N steps of this invocation, as if preempted",
    )
    p.add_argument("--log-every", type=int, default=25, help="print the loss (25)")
    p.add_argument(
        "--eval-every", type=int, default=0, help="held-out loss every N steps (0)"
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=8,
        help="batches of the held-out loss, computed at the end (8; 0: none)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def run_config(args: argparse.Namespace, saved: dict[str, Any] | None) -> RunConfig:
    """The run's `RunConfig`: the command line over the checkpoint's (`saved`) or
    the defaults. A value given on the command line must equal the saved one."""
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(RunConfig)
        if getattr(args, f.name) is not None
    }
    if saved is None:
        return RunConfig(**given)
    mismatched = [
        f"--{k.replace('_', '-')}: checkpoint has {saved[k]!r}, got {v!r}"
        for k, v in given.items()
        if saved[k] != v
    ]
    if mismatched:
        raise UsageError(
            "--resume: these options define the run and differ from the "
            "checkpoint's (leave them out to use the checkpoint's): "
            + "; ".join(mismatched)
        )
    return RunConfig(**saved)


def check_config(c: RunConfig) -> None:
    for name in ("steps", "batch", "seq", "d_model", "heads", "layers"):
        if getattr(c, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1.")
    if c.d_model % c.heads != 0:
        raise UsageError(
            f"--d-model must be divisible by --heads. Got {c.d_model} and {c.heads}."
        )
    if not 0 <= c.warmup < c.steps:
        raise UsageError(
            f"--warmup must be in [0, steps). Got {c.warmup} with {c.steps} steps."
        )
    if not 0 < c.val_fraction < 1:
        raise UsageError(f"--val-fraction must be in (0, 1). Got {c.val_fraction}.")


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
        if isinstance(x, eqx.nn.Linear):
            m = jax.tree.map(lambda _: False, x)
            return eqx.tree_at(lambda lin: lin.weight, m, True)
        return False

    is_linear = lambda x: isinstance(x, eqx.nn.Linear)
    return jax.tree.map(mark, params, is_leaf=is_linear)


def learning_rate_schedule(c: RunConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup` steps, then a cosine decay to
    `lr * min_lr_ratio` at step `steps`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=c.lr,
        warmup_steps=c.warmup,
        decay_steps=c.steps,
        end_value=c.lr * c.min_lr_ratio,
    )


@functools.lru_cache(maxsize=8)
def make_optimizer(c: RunConfig) -> optax.GradientTransformation:
    """Clipping, then AdamW on a warmup + cosine schedule. (Cached: an equal
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
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.mean(losses)


@eqx.filter_jit(donate="all-except-first")
def train_step(
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


@eqx.filter_jit
def eval_loss(model: zoo.Transformer, tokens: jax.Array) -> jax.Array:
    return loss_fn(eqx.nn.inference_mode(model), tokens, None)


# ------------------------------------------------------------------------ checkpoints


def save_checkpoint(path: Path, header: dict[str, Any], state: TrainState) -> None:
    """Write `header` (one JSON line) and `state` to `path` atomically: a temp file
    in the same directory, fsynced, then `os.replace`d over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(header, sort_keys=True).encode() + b"\n")
            eqx.tree_serialise_leaves(f, state)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        header = json.loads(f.readline())
    if header.get("format") != FORMAT:
        raise UsageError(
            f"{path}: expected a checkpoint of format {FORMAT!r}. "
            f"Got {header.get('format')!r}."
        )
    return header


def load_checkpoint(path: Path, c: RunConfig) -> TrainState:
    """The `TrainState` saved in `path` for a run of config `c`."""
    like = eqx.filter_eval_shape(init_state, c)
    with open(path, "rb") as f:
        f.readline()  # the header
        state = eqx.tree_deserialise_leaves(f, like)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(like)):
        if eqx.is_array(a) and (a.shape, a.dtype) != (b.shape, b.dtype):
            raise UsageError(
                f"{path}: expected an array {b.dtype}{list(b.shape)}. "
                f"Got {a.dtype}{list(a.shape)}."
            )
    return state


# ------------------------------------------------------------------------------ main


class TrainResult(NamedTuple):
    """What `main` returns (for tests and notebooks)."""

    state: TrainState
    losses: list[float]  # the training loss of each step of this invocation
    first_step: int  # the step number of `losses[0]`
    eval_loss: float | None  # the final held-out loss, if computed


def main(argv: Sequence[str] | None = None) -> TrainResult:
    args = parse_args(argv)
    console = Console(stderr=False)
    ckpt_path = args.ckpt_dir / CHECKPOINT_FILE if args.ckpt_dir else None

    saved = None
    if args.resume:
        if ckpt_path is None:
            raise UsageError("--resume needs --ckpt-dir.")
        if not ckpt_path.exists():
            raise UsageError(f"--resume: no checkpoint at {ckpt_path}.")
        saved = read_header(ckpt_path)
    c = run_config(args, saved and saved["config"])
    check_config(c)
    checkpoint = parse_checkpoint(args.checkpoint)
    mesh = parse_mesh(args.mesh)
    placement = None
    if mesh is not None:
        strategy, n = mesh
        if c.batch % n != 0:
            raise UsageError(
                f"--mesh {args.mesh}: --batch must be divisible by {n} devices. "
                f"Got {c.batch}."
            )
        devices = jax.devices()[:n]
        axis_types = (AxisType.Auto,)
        m = jax.make_mesh((n,), ("data",), axis_types, devices=devices)
        placement = Placement(m, fsdp=strategy == "fsdp")

    corpus, digest = load_corpus(c.data_bytes)
    split = len(corpus) - int(len(corpus) * c.val_fraction)
    train, val = corpus[:split], corpus[split:]
    if min(len(train), len(val)) <= c.seq:
        raise UsageError(
            f"The corpus ({len(corpus)} bytes, {len(val)} held out) is too small "
            f"for --seq {c.seq}: raise --data-bytes or --val-fraction."
        )
    if saved is not None and saved["corpus_sha256"] != digest:
        raise UsageError(
            f"--resume: the corpus differs from the checkpoint's (another Python's "
            f"standard library?): sha256 {digest[:12]} != "
            f"{saved['corpus_sha256'][:12]}. Batches would not match."
        )

    if saved is not None:
        state = load_checkpoint(ckpt_path, c)
    else:
        state = init_state(c)
    # `checkpoint` is not part of the run: it changes memory and FLOPs only. It is a
    # static field, so it is also in the treedef of the Adam moments (pytrees shaped
    # like the model): replace it in the whole state, not just in the model.
    state = eqx_remat.set_checkpoint(state, checkpoint)
    if placement is not None:
        state = placement.params(state)
    optimizer = make_optimizer(c)

    def learning_rate(step: int) -> float:
        with jax.numpy_dtype_promotion("standard"):
            return float(learning_rate_schedule(c)(step))

    first = int(state.step)
    last = c.steps if args.stop_after is None else min(c.steps, first + args.stop_after)
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array)))
    console.print(
        f"zoo.Transformer: {params:,} parameters, d_model {c.d_model}, {c.layers} "
        f"layers, {c.heads} heads, seq {c.seq}, batch {c.batch}, {c.dtype}; "
        f"checkpoint={checkpoint!r}; mesh={args.mesh}; corpus {len(train):,} + "
        f"{len(val):,} held-out bytes of {sysconfig.get_paths()['stdlib']}; "
        f"steps {first} -> {last} of {c.steps}"
    )

    def header(step: int) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "step": step,
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

    losses: list[jax.Array] = []
    evaluated: tuple[int, float] = (-1, math.nan)  # the latest held-out loss
    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("loss {task.fields[loss]}"),
    )
    window_start, window_time = first, time.perf_counter()
    with Progress(*columns, console=console, disable=args.no_progress) as progress:
        task = progress.add_task("train", total=c.steps, completed=first, loss="-")
        for step in range(first, last):
            tokens = sample(train, c.seq, c.batch, (c.seed, 0, step))
            if placement is not None:
                tokens = placement.batch(tokens)
            loss, state = train_step(
                (tokens, jnp.int32(step)), state, optimizer, placement
            )
            losses.append(loss)
            done = step + 1
            if done % args.log_every == 0 or done == last:
                window = [float(x) for x in losses[window_start - first :]]
                mean = sum(window) / len(window)
                now = time.perf_counter()
                rate = len(window) * c.batch * c.seq / (now - window_time)
                progress.update(task, loss=f"{mean:.4f}")
                progress.console.print(
                    f"step {done:>6}  loss {mean:.4f}  "
                    f"({mean / math.log(2):.3f} bits/byte)  "
                    f"lr {learning_rate(step):.2e}  {rate:,.0f} tokens/s"
                )
                window_start, window_time = done, time.perf_counter()
            start = time.perf_counter()
            if args.eval_every and done % args.eval_every == 0 and args.eval_batches:
                evaluated = (done, held_out_loss(state.model))
                progress.console.print(
                    f"step {done:>6}  held-out loss {evaluated[1]:.4f}"
                )
            if ckpt_path and args.save_every and done % args.save_every == 0:
                save_checkpoint(ckpt_path, header(done), state)
            window_time += time.perf_counter() - start  # tokens/s counts steps only
            progress.update(task, completed=done)

    if ckpt_path is not None:
        save_checkpoint(ckpt_path, header(last), state)
        console.print(f"saved step {last} to {ckpt_path}")
    final_eval = None
    if args.eval_batches and last == c.steps:
        final_eval = (
            evaluated[1] if evaluated[0] == last else held_out_loss(state.model)
        )
        console.print(
            f"held-out loss {final_eval:.4f} "
            f"({final_eval / math.log(2):.3f} bits/byte) after {last} steps"
        )
    return TrainResult(state, [float(x) for x in losses], first, final_eval)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UsageError as e:
        sys.exit(f"error: {e}")

"""What defines a run (`RunConfig`), the command line, and every check that can be
made before training starts."""

import argparse
import dataclasses
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from benchmarks import _common as C, _device


VOCAB_SIZE = 256  # bytes
FORMAT = "eqx-remat/train_lm/2"
SCRIPT = "train_lm"
SEED_MAX = 2**31 - 1  # jax.random.key keeps 32 bits of a seed without x64


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
    data: str | None = None  # a file or directory of text; None: the stdlib
    data_bytes: int | None = None
    val_fraction: float = 0.05


# ------------------------------------------------------------------ argparse types


def _float_in(low: float, high: float, *, closed_low: bool, name: str):
    """An argparse `type`: a finite float in the interval `name` describes."""

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


def seed_type(text: str) -> int:
    """`--seed`: an integer in [0, 2**31 - 1]."""
    seed = C.non_negative_int(text)
    if seed > SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected at most {SEED_MAX}. Got {seed}.")
    return seed


def remat_spec(spec: str) -> str:
    """`--remat`: checked with the parser shared by every script (the
    depth-dependent forms `every:sqrt`, `binomial:log2` are resolved later)."""
    try:
        C.parse_checkpoint(spec, depth=1)
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
    return head, C.positive_int(count) if count else None


# ------------------------------------------------------------------------- parser


def build_parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_lm.py",
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_args(p.add_argument_group("model and data (with --resume: the saved run's)"))
    _optimiser_args(p.add_argument_group("optimiser (with --resume: the saved run's)"))
    _run_args(p)
    _device.add_device_args(p)
    return p


def _model_args(run: argparse._ArgumentGroup) -> None:
    d = RunConfig()
    positive = C.positive_int
    run.add_argument("--seed", type=seed_type, help=f"init, data, dropout ({d.seed})")
    run.add_argument("--batch", type=positive, help=f"sequences ({d.batch})")
    run.add_argument("--seq", type=positive, help=f"tokens per row ({d.seq})")
    run.add_argument("--d-model", type=positive, help=f"width ({d.d_model})")
    run.add_argument("--heads", type=positive, help=f"attention heads ({d.heads})")
    run.add_argument("--layers", type=positive, help=f"blocks ({d.layers})")
    run.add_argument("--d-ff", type=positive, help="MLP hidden size (4 * d_model)")
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
        "--data",
        metavar="PATH",
        help="a text file, or a directory of them (read as bytes, in sorted path "
        "order; hidden and binary files skipped) (the Python standard library's "
        ".py sources)",
    )
    run.add_argument(
        "--data-bytes", type=positive, help="use only the first N corpus bytes"
    )
    run.add_argument(
        "--val-fraction",
        type=_float_in(0.0, 1.0, closed_low=False, name="(0, 1)"),
        help=f"held-out tail of the corpus ({d.val_fraction})",
    )


def _optimiser_args(run: argparse._ArgumentGroup) -> None:
    d = RunConfig()
    positive_real = _float_in(0.0, math.inf, closed_low=False, name="(0, inf)")
    non_negative_real = _float_in(0.0, math.inf, closed_low=True, name="[0, inf)")
    run.add_argument(
        "--steps", type=C.positive_int, help=f"total optimiser steps ({d.steps})"
    )
    run.add_argument("--lr", type=positive_real, help=f"peak learning rate ({d.lr})")
    run.add_argument(
        "--schedule",
        choices=["cosine", "constant"],
        help="after the warmup: cosine decay to --min-lr-ratio * lr at --steps, "
        "or constant (a run that --resume can extend) (cosine)",
    )
    run.add_argument(
        "--warmup",
        type=C.non_negative_int,
        help=f"linear warmup steps (a tenth of --steps: {d.warmup} at {d.steps})",
    )
    run.add_argument(
        "--min-lr-ratio",
        type=non_negative_real,
        help=f"final / peak learning rate of the cosine ({d.min_lr_ratio})",
    )
    run.add_argument(
        "--weight-decay",
        type=non_negative_real,
        help=f"AdamW decay of the linear weights ({d.weight_decay})",
    )
    run.add_argument(
        "--clip", type=positive_real, help=f"global gradient norm ({d.clip})"
    )


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--remat",
        type=remat_spec,
        default="dots",
        metavar="SPEC",
        help="how the blocks are rematerialised: None, a policy name, every:K[:POLICY] "
        "or every(K[, POLICY]), nested:L, recursive, binomial:S (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--mesh",
        type=mesh_spec,
        default="auto",
        help="auto (dp over all devices if several), none, dp[:N] or fsdp[:N] "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--save-dir",
        type=Path,
        metavar="DIR",
        help="the run directory: Orbax checkpoints, metrics.jsonl, TensorBoard "
        "events, loss.png (default: no checkpoints; metrics in a fresh "
        f"benchmarks/runs/{SCRIPT}-<date>/)",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from SAVE_DIR's newest good one"
    )
    _every(p, "--save-every", 100, "save every N steps, and at the end")
    _every(p, "--keep", 3, "checkpoints kept: the newest N")
    p.add_argument(
        "--stop-after",
        type=C.positive_int,
        metavar="N",
        help="stop (and save) after N steps of this invocation, as if preempted",
    )
    _every(p, "--log-every", 25, "log the loss every N steps")
    _every(p, "--eval-every", 0, "held-out loss every N steps (0: only at the end)", 0)
    _every(p, "--eval-batches", 8, "batches of the held-out loss (0: none)", 0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _every(
    p: argparse.ArgumentParser, flag: str, default: int, text: str, least: int = 1
) -> None:
    """A count flag: an integer >= `least` (1 or 0)."""
    p.add_argument(
        flag,
        type=C.positive_int if least else C.non_negative_int,
        default=default,
        metavar="N",
        help=f"{text} (default: %(default)s)",
    )


def parse_args(
    argv: Sequence[str] | None, parser: argparse.ArgumentParser
) -> argparse.Namespace:
    """Parse and check every flag that can be checked before JAX starts; settle
    `args.run_dir` (`--save-dir`, or a fresh default that holds no checkpoints)."""
    args = parser.parse_args(argv)
    if args.resume and args.save_dir is None:
        parser.error("argument --resume: needs --save-dir.")
    if args.resume and not args.save_dir.is_dir():
        parser.error(
            f"argument --resume: {args.save_dir} is not a directory: there is no "
            "run to resume."
        )
    if args.data is not None:
        problem = data_problem(Path(args.data))
        if problem:
            parser.error(f"argument --data: {problem}")
    if args.save_dir is None:  # made when the first metrics are written
        args.run_dir = C.run_dir(SCRIPT)
        return args
    args.run_dir = args.save_dir
    problem = writable_problem(args.run_dir)
    if problem:
        parser.error(
            f"argument --save-dir: {args.run_dir} is not a writable directory "
            f"({problem})."
        )
    return args


def writable_problem(path: Path) -> str | None:
    """Why `path` cannot be a directory to write in, or `None`. Tried, not
    guessed: the directories missing on the way are made, a file written and
    removed, and what was made removed again, so that a run whose other flags
    fail leaves nothing behind (the run makes it when it starts writing)."""
    made = []
    try:
        for parent in [*reversed(path.absolute().parents), path.absolute()]:
            if not parent.exists():
                parent.mkdir()
                made.append(parent)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return str(e.strerror or e)
    finally:
        for d in reversed(made):
            d.rmdir()
    return None


def data_problem(path: Path) -> str | None:
    """Why `--data path` cannot be read (before JAX starts), or `None`."""
    if not path.exists():
        return f"{path} does not exist."
    if path.is_file():
        return None if path.stat().st_size else f"{path} is empty."
    if not path.is_dir():
        return f"{path} is neither a file nor a directory."
    from .data import text_files

    if not any(p.stat().st_size for p in text_files(path)):
        return f"{path} holds no text file with any bytes (hidden and binary files "
        "are skipped)."
    return None


# -------------------------------------------------------------- run configuration


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
    if "data" in given:  # the same file however it is spelled
        given["data"] = str(Path(given["data"]).resolve())
    if saved is None:
        if "dtype" not in given and platform == "tpu":
            given["dtype"] = "bfloat16"
        if "warmup" not in given:  # scales with --steps (30 of the default 300)
            given["warmup"] = given.get("steps", RunConfig.steps) // 10
        return RunConfig(**given)
    saved = {**dataclasses.asdict(RunConfig()), **saved}
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


def check_remat(spec: str, checkpoint: Any, layers: int) -> None:
    """`--remat` against `--layers`, before anything runs: `ranges` counts must
    add up to the layers, and a schedule must be able to act as asked
    (`every(k)` needs `k` layers or more in its range: with fewer there is one
    segment, and nothing is split)."""
    import eqx_remat as er

    if isinstance(checkpoint, er.Schedule):
        try:
            checkpoint.check_depth(layers)
        except ValueError as e:
            raise UsageError(f"--remat {spec} with --layers {layers}: {e}") from None
    ranged = isinstance(checkpoint, er.ranges)
    parts = checkpoint.parts if ranged else [(layers, checkpoint)]
    for n, c in parts:
        if isinstance(c, er.every) and c.k > n:
            where = "" if n == layers else f" in a range of {n}"
            raise UsageError(
                f"--remat {spec}: every({c.k}) stores one carry every {c.k} layers, "
                f"but there are {n} layers{where} (--layers {layers}): it would "
                f"store only the input. Use every(K) with K <= {n}."
            )


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

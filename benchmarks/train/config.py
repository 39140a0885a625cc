"""The run's options (`RunConfig`), the command line (`Flags`: tyro derives the
flags from the fields and their docstrings), and the checks made before training."""

import argparse
import ast
import dataclasses
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import jax
import numpy as np
import optax
import tyro

import eqx_remat as er
from benchmarks import _device
from benchmarks._files import writable_problem

from .files import data_problem, run_dir


VOCAB_SIZE = 256  # bytes
FORMAT = "eqx-remat/train_lm/2"
SEED_MAX = 2**31 - 1  # jax.random.key keeps 32 bits of a seed without x64


class UsageError(ValueError):
    """A bad command line or checkpoint: reported in one `error:` line, rc 2."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Model, data and optimiser (with --resume: the saved run's; given ones must
    match it, but --steps may grow)."""

    seed: int = 0  # init, data, dropout
    steps: int = 300  # total optimiser steps
    batch: int = 16  # sequences per step
    seq: int = 128  # tokens per row
    d_model: int = 128  # width
    heads: int = 4  # attention heads
    layers: int = 4  # blocks
    d_ff: int | None = None  # MLP hidden size (None: 4 * d_model)
    dropout: float = 0.0  # dropout rate, in [0, 1)
    dtype: Literal["float32", "bfloat16"] = "float32"
    """compute dtype (on a TPU, bfloat16 unless given)"""
    lr: float = 3e-3  # peak learning rate
    schedule: Literal["cosine", "constant"] = "cosine"
    """after the warmup: cosine decay to min_lr_ratio * lr at --steps, or constant
    (a run that --resume can extend)"""
    warmup: Annotated[
        int,
        tyro.conf.arg(
            help="linear warmup steps",
            help_behavior_hint="(default: a tenth of --steps, rounded down)",
        ),
    ] = 30  # the default's, 300 steps; `run_config` sets it from --steps
    min_lr_ratio: float = 0.1  # final / peak learning rate of the cosine
    weight_decay: float = 0.1  # AdamW decay of the linear weights
    clip: float = 1.0  # global gradient norm
    data: str | None = None
    """a text file, or a directory of them, read as bytes (None: the Python
    standard library's .py sources)"""
    data_bytes: int | None = None  # use only the first N corpus bytes
    val_fraction: float = 0.05  # held-out tail of the corpus


def _help(flag: str, hint: str | None = None) -> Any:
    """The help of `_device`'s flag `flag` (`hint`: in place of its default)."""
    return tyro.conf.arg(help=_device.HELP[flag], help_behavior_hint=hint)


@dataclasses.dataclass(frozen=True)
class Flags:
    """The command line: the run's `RunConfig`, then how this invocation runs it."""

    run: Annotated[RunConfig, tyro.conf.OmitArgPrefixes] = RunConfig()
    remat: str = "dots"
    """how the blocks are rematerialised: None, a policy name, every:K[:POLICY] or
    every(K[, POLICY]), nested:L, recursive, binomial:S, ranges(N:SPEC, ...); with
    --resume, the saved run's unless given"""
    mesh: str = "auto"  # auto (dp over all devices if several), none, dp[:N], fsdp[:N]
    save_dir: Path | None = None
    """the run directory: Orbax checkpoints, metrics.jsonl, TensorBoard events,
    loss.png (None: no checkpoints; metrics in benchmarks/runs/train_lm-<date>/)"""
    resume: bool = False  # continue from SAVE_DIR's newest good checkpoint
    save_every: int = 100  # save every N steps, and at the end
    keep: int = 3  # checkpoints kept: the newest N
    stop_after: int | None = None
    """stop (and save) after N steps of this invocation, as if preempted"""
    log_every: int = 25  # log the loss every N steps
    eval_every: int = 0  # held-out loss every N steps (0: only at the end)
    eval_batches: int = 8  # batches of the held-out loss (0: none)
    no_progress: bool = False  # no progress bar
    device: Annotated[Literal["auto", "tpu", "gpu", "cpu"], _help("device")] = "auto"
    distributed: Annotated[bool, _help("distributed")] = False
    coordinator_address: Annotated[str | None, _help("coordinator_address")] = None
    num_processes: Annotated[int | None, _help("num_processes")] = None
    process_id: Annotated[int | None, _help("process_id")] = None
    heartbeat_timeout: Annotated[
        int | None, _help("heartbeat_timeout", "(default: 100)")
    ] = None
    run_dir: tyro.conf.Suppress[Path | None] = None  # --save-dir, or a fresh one
    given: tyro.conf.Suppress[frozenset[str]] = frozenset()  # RunConfig fields given
    remat_given: tyro.conf.Suppress[bool] = False  # --remat spelt out


# The bounds of the numeric flags.
POSITIVE = ("steps", "batch", "seq", "d_model", "heads", "layers", "d_ff")
POSITIVE += ("data_bytes", "save_every", "keep", "stop_after", "log_every")
POSITIVE += ("num_processes", "heartbeat_timeout")
NON_NEGATIVE = ("seed", "warmup", "eval_every", "eval_batches", "process_id")
REAL = {"dropout": "[0, 1)", "val_fraction": "(0, 1)", "lr": "(0, inf)"}
REAL |= {"min_lr_ratio": "[0, inf)", "weight_decay": "[0, inf)", "clip": "(0, inf)"}


def _bound_problem(name: str, x: Any) -> str | None:
    """What is wrong with the value `x` of flag `name` (see the bounds), or `None`."""
    if name in POSITIVE + NON_NEGATIVE:
        parse = _device.positive_int if name in POSITIVE else _device.non_negative_int
        try:
            parse(str(x))
        except argparse.ArgumentTypeError as e:
            return str(e)
    if name == "seed" and x > SEED_MAX:
        return f"expected at most {SEED_MAX}. Got {x}."
    if name in REAL:
        interval = REAL[name]
        low, high = map(float, interval[1:-1].split(", "))
        above = low <= x if interval[0] == "[" else low < x
        if not (above and x < high):  # false for NaN and inf too
            return f"must be in {interval}. Got {float(x)}."
    return None


# Prints the usage and a bad flag's `error:` line, then exits with status 2.
USAGE = argparse.ArgumentParser(prog="train_lm.py", usage="%(prog)s [-h] [OPTIONS]")


def help_text() -> str:
    """The `--help` text: the package's docstring, read from its file (to
    import the package here would be an import cycle: it imports this)."""
    init = Path(__file__).with_name("__init__.py")
    return ast.get_docstring(ast.parse(init.read_text()), clean=False) or ""


def parse_args(argv: Sequence[str] | None) -> Flags:
    """The command line `argv` (default `sys.argv[1:]`) as checked `Flags` (a bad
    flag exits, status 2), with `run_dir` (`--save-dir`, else a fresh default)
    and `given` (the `RunConfig` fields spelt out) settled."""
    doc = help_text()
    argv = list(sys.argv[1:] if argv is None else argv)
    config = (tyro.conf.FlagCreatePairsOff,)
    flags = tyro.cli(
        Flags, args=argv, prog="train_lm.py", description=doc, config=config
    )
    for name, problem in _problems(flags):
        if problem:
            USAGE.error(f"argument --{name.replace('_', '-')}: {problem}")
    spoken = {a[2:].split("=")[0].replace("-", "_") for a in argv if a[:2] == "--"}
    given = frozenset(f.name for f in dataclasses.fields(RunConfig)) & spoken
    fresh = flags.save_dir or run_dir("train_lm")  # made when written
    remat_given = "remat" in spoken
    return dataclasses.replace(
        flags, run_dir=fresh, given=given, remat_given=remat_given
    )


def _problems(flags: Flags) -> Iterator[tuple[str, str | None]]:
    """`(flag, its problem or None)`, lazily: the first problem stops the script,
    before `--save-dir` is tried (and what that makes removed again)."""
    values = dataclasses.asdict(flags.run) | dataclasses.asdict(flags)
    yield from ((k, _bound_problem(k, x)) for k, x in values.items() if x is not None)
    yield "remat", remat_problem(flags.remat)
    try:
        mesh_spec(flags.mesh)
    except ValueError as e:
        yield "mesh", str(e)
    if flags.coordinator_address is not None:
        yield "coordinator-address", _device.address_problem(flags.coordinator_address)
    if flags.eval_every and not flags.eval_batches:
        yield "eval-every", "needs --eval-batches > 0: with 0 nothing is evaluated."
    if flags.resume and flags.save_dir is None:
        yield "resume", "needs --save-dir."
    elif flags.resume and not flags.save_dir.is_dir():
        no_run = "is not a directory: there is no run to resume."
        yield "resume", f"{flags.save_dir} {no_run}"
    if flags.run.data is not None:
        yield "data", data_problem(Path(flags.run.data))
    save_dir = flags.save_dir
    if save_dir is not None and (problem := writable_problem(save_dir)):
        yield "save-dir", f"{flags.save_dir} is not a writable directory ({problem})."


def remat_problem(spec: str) -> str | None:
    """What is wrong with `--remat spec`, or `None` (forms that depend on the
    depth, `every:sqrt`, `binomial:log2`, are resolved later)."""
    try:
        er.parse_checkpoint(spec, depth=1)
    except (ValueError, TypeError) as e:
        return f"invalid checkpoint {spec!r}: {e}"
    return None


def mesh_spec(spec: str) -> tuple[str, int | None] | None:
    """`--mesh` as `("auto"|"dp"|"fsdp", devices or None)`, or `None` for `none`;
    raises `ValueError` for anything else."""
    head, _, count = spec.strip().lower().partition(":")
    if head in ("none", "auto") and not count:
        return None if head == "none" else ("auto", None)
    if head not in ("dp", "fsdp") or (count and not (count.isdigit() and int(count))):
        raise ValueError(
            f"expected auto, none, dp[:DEVICES] or fsdp[:DEVICES]. Got {spec!r}."
        )
    return head, int(count) if count else None


def run_config(flags: Flags, saved: dict[str, Any] | None, platform: str) -> RunConfig:
    """The run's `RunConfig`: the flags given over the checkpoint's (`saved`) or
    the defaults. A `UsageError` if a given one differs from the saved one (but
    `steps`: see `check_extension`) or the options do not fit together."""
    given = {k: getattr(flags.run, k) for k in flags.given}
    if "data" in given:  # the same file however it is spelled
        given["data"] = str(Path(given["data"]).resolve())
    if saved is None:
        if "dtype" not in given and platform == "tpu":
            given["dtype"] = "bfloat16"
        if "warmup" not in given:  # scales with --steps (30 of the default 300)
            given["warmup"] = given.get("steps", RunConfig.steps) // 10
        c = RunConfig(**given)
    else:
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
        c = RunConfig(**{**saved, "steps": given.get("steps", saved["steps"])})
    if c.d_model % c.heads != 0:
        raise UsageError(
            f"--d-model must be divisible by --heads. Got {c.d_model} and {c.heads}."
        )
    if not c.warmup < c.steps:
        raise UsageError(
            f"--warmup must be in [0, steps). Got {c.warmup} with {c.steps} steps."
        )
    return c


def check_remat(spec: str, checkpoint: Any, layers: int) -> None:
    """A `UsageError` unless `--remat` fits `--layers` as the library says
    (`Schedule.check_depth`: a `ranges` adds up to the layers). One rule, the
    library's: whatever it runs, the script runs (`every(K)` with `K` at least
    the layers of its range re-runs them as one segment)."""
    import eqx_remat as er

    if isinstance(checkpoint, er.Schedule):
        try:
            checkpoint.check_depth(layers)
        except ValueError as e:
            raise UsageError(f"--remat {spec} with --layers {layers}: {e}") from None


def learning_rate_schedule(c: RunConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup` steps, then either a cosine decay
    to `lr * min_lr_ratio` at step `steps` or a constant `lr`."""
    if c.schedule == "constant" and c.warmup == 0:
        return optax.constant_schedule(c.lr)
    if c.schedule == "constant":
        return optax.warmup_constant_schedule(0.0, c.lr, c.warmup)
    end = c.lr * c.min_lr_ratio
    return optax.warmup_cosine_decay_schedule(0.0, c.lr, c.warmup, c.steps, end)


def check_extension(saved: RunConfig, c: RunConfig, at_step: int) -> None:
    """A `UsageError` unless the steps `0..at_step - 1` of the run `saved` keep
    their learning rates with `c.steps` steps (as one run of `c.steps` would)."""
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
        raise UsageError(
            f"--steps {c.steps}: the {c.schedule} learning-rate schedule of this "
            f"run depends on its length ({saved.steps} steps), and steps "
            f"{int(np.argmax(old != new))} to {at_step - 1} already taken would have "
            f"had other learning rates. Resume with --steps {saved.steps}, or start "
            "runs meant to be extended with --schedule constant."
        )

"""The command line every measuring script shares (`parser`, `parse_args`): a
flag means the same in every script and is checked before any work starts, a
checkpoint spec is `eqx_remat.parse_checkpoint`'s syntax."""

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import eqx_remat as er

from . import _device
from ._files import writable_problem
from ._results import RESULTS, run_dir


def _spec_type(spec: str) -> str:
    er.parse_checkpoint(spec, depth=16)  # syntax only: sqrt/log2 resolve per preset
    return spec


def parse_bytes(text: str) -> int:
    """`"16GiB"`, `"1.5GB"`, `"1000"` → bytes: the library's parser."""
    return er.parse_bytes(text, name="the size")


def _target_type(text: str) -> str:
    if er.internal.slice_shape(text) is None:
        raise ValueError(
            "expected a TPU target: v5e, v5e:AxB, v6e:AxB or v5p:AxBxC (e.g. "
            f"v5e:2x4), or Nx before one. Got {text!r}."
        )
    try:
        er.v5e_mesh(text)  # a slice libtpu knows, before any work
    except ImportError as e:
        raise ValueError(str(e)) from None
    return text


def _checked(fn: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """An argparse `type` (named `name` in errors) that reports `fn`'s
    `ValueError` as it is."""

    def check(text: str) -> Any:
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    check.__name__ = name
    return check


positive_int = _device.positive_int  # an argparse `type`: integers >= 1


def int_flag(
    p: argparse.ArgumentParser,
    flag: str,
    default: Any,
    what: str = "",
    metavar: str | None = "N",
    **kw: Any,
) -> None:
    """A flag of integers >= 1 (`kw`: more of `add_argument`'s)."""
    text = f"{what} (default: %(default)s)".lstrip()
    p.add_argument(
        flag, type=positive_int, default=default, metavar=metavar, help=text, **kw
    )


def parser(
    doc: str,
    *,
    presets: Sequence[str] = (),
    repeats: int | None = 5,
    target: bool = True,
    runs: bool = False,
) -> argparse.ArgumentParser:
    """The flags every script shares (`presets`: what `--preset` accepts;
    `repeats=None`: no `--repeats`; `target`: `--target`; `runs`: the script
    runs steps, with `--memory-limit` and `--isolate`)."""
    p = argparse.ArgumentParser(
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="directory for the results (default: a fresh benchmarks/runs/"
        "<script>-<date>/, so nothing is overwritten)",
    )
    p.add_argument(
        "--update-results",
        action="store_true",
        help="write into benchmarks/results/, replacing the committed results "
        "(default: off)",
    )
    if presets:
        p.add_argument(
            "--preset",
            nargs="+",
            choices=list(presets),
            metavar="NAME",
            help=f"what to measure, any of: {', '.join(presets)} "
            "(default: the script's own list)",
        )
    p.add_argument(
        "--checkpoint",
        nargs="+",
        type=_checked(_spec_type, "checkpoint"),
        metavar="SPEC",
        help="checkpoints to compare, e.g. None dots every:4:dots nested:3 recursive "
        "binomial:log2, or written as calls (quoted for the shell): "
        "'every(4, dots)' 'ranges(4:dots, 12:None)' (default: each preset's own "
        "list)",
    )
    if target:
        p.add_argument(
            "--target",
            type=_checked(_target_type, "target"),
            metavar="v5e[:AxB]",
            help="compile for TPU v5e ahead of time (v5e is a 2x2 slice, v5e:AxB "
            "another one v5e comes in) and run nothing: per-chip memory and FLOPs "
            "(default: run on --device)",
        )
    if repeats is not None:
        int_flag(p, "--repeats", repeats, "timed steps per variant, after one warm-up")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny presets, end to end; flags given keep their values (default: off)",
    )
    _device.add_device_args(p)
    if runs:
        _add_run_args(p)
    return p


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """A script that runs steps: how its variants are kept apart."""
    p.add_argument(
        "--memory-limit",
        type=_checked(parse_bytes, "memory-limit"),
        metavar="SIZE",
        help="report variants whose compiled memory exceeds this as not fitting, "
        "without running them, e.g. 15GiB (default: none)",
    )
    p.add_argument(
        "--isolate",
        choices=("auto", "always", "never"),
        default="auto",
        help="measure each variant in its own process (auto: on a TPU or GPU, "
        "where peak memory is measured) (default: %(default)s)",
    )
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)


def isolate(args: argparse.Namespace) -> bool:
    """Whether this process starts one process per variant (and so must not
    open the device)."""
    if getattr(args, "worker", None) or getattr(args, "target", None):
        return False
    if not hasattr(args, "isolate"):
        return False
    accel = _device.resolve_device(args.device) not in ("cpu",)
    return args.isolate == "always" or (args.isolate == "auto" and accel)


# Flags that act only where steps run: an error where nothing runs.
RUN_ONLY = ("repeats", "memory_limit", "isolate")


_UNSET = object()


def parse_args(
    p: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    script: str,
    defer: Callable[[argparse.Namespace], bool] = lambda args: False,
    *,
    quick: dict[str, Any] | None = None,
    check: Callable[[argparse.Namespace], str | None] = lambda args: None,
    compiles_only: Callable[[argparse.Namespace], str | None] | None = None,
    run_only: Sequence[str] = RUN_ONLY,
) -> argparse.Namespace:
    """Parse and check every flag, pick the device (only name it where
    `defer(args)`: one process per measurement), settle `args.out`. With
    `--quick`, the flags of `quick` not given take its values; `check(args)`
    says what else is wrong (e.g. a checkpoint for a preset's depth). Where
    `compiles_only(args)` gives a reason (default: `--target`), a flag of
    `run_only` given is an error: nothing runs."""
    args = p.parse_args(argv)
    blank = argparse.Namespace(**dict.fromkeys(vars(args), _UNSET))
    given = {k for k, v in vars(p.parse_args(argv, blank)).items() if v is not _UNSET}
    for k, v in (quick or {}).items() if args.quick else ():
        setattr(args, k, getattr(args, k) if k in given else v)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.script = script
    if args.out is not None and args.update_results:
        p.error("--out and --update-results exclude each other.")
    if compiles_only is None:
        why = "with --target (compiled ahead of time)" * bool(
            getattr(args, "target", None)
        )
    else:
        why = compiles_only(args)
    flags = {a.dest: a.option_strings[-1] for a in p._actions if a.option_strings}
    for k in run_only:
        if why and k in given:
            p.error(f"{flags[k]} has no effect {why}: nothing runs.")
    args.deferred = defer(args)
    args.platform = _device.select_device(args, p, initialise=not args.deferred)
    if problem := check(args):
        p.error(problem)
    if args.deferred:
        there = {"tpu": _device._has_tpu, "cuda": _device._has_gpu}.get(args.platform)
        if args.device != "auto" and there is not None and not there():
            p.error(
                f"--device {args.device}: no {args.platform} device here. Use "
                "--device auto to take what the machine has."
            )
        _device.set_main(not args.distributed)
    if args.update_results:
        args.out = RESULTS
    elif args.out is None:
        args.out = run_dir(script)
    if problem := writable_problem(args.out):
        p.error(f"--out {args.out}: cannot write there: {problem}")
    return args


def depth_problem(specs: Sequence[str] | None, depths: dict[str, int]) -> str | None:
    """Why a `--checkpoint` spec cannot checkpoint a stack it would run on
    (`depths`: a name for each stack, its depth), or `None`."""
    for spec in specs or ():
        for name, depth in depths.items():
            try:
                c = er.parse_checkpoint(spec, depth)
                if isinstance(c, er.Schedule):
                    c.check_depth(depth)
            except ValueError as e:
                return f"--checkpoint {spec} on {name} ({depth} layers): {e}"
    return None


def presets_problem(specs: Sequence[str] | None, names: Sequence[str]) -> str | None:
    """Why a `--checkpoint` spec cannot checkpoint a preset of `names` (of
    `_models.PRESETS`), or `None`."""
    from ._models import PRESETS

    depths = {
        f"--preset {n}" + (f" {path}" if path else ""): depth
        for n in names
        for path, depth in PRESETS[n].stack_depths().items()
    }
    return depth_problem(specs, depths)

"""What every benchmark script shares: the command line (`parser`: a flag means
the same in every script and is checked before any work starts), the checkpoint
spec syntax, and the output (rich tables, progress, JSON + CSV + PNG), which
only process 0 of a multi-host run prints and writes."""

import argparse
import contextlib
import csv
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import rich.box
import rich.console
import rich.progress
import rich.table
from rich.markup import escape

import eqx_remat as er
from eqx_remat.internal import format_flops

from . import _device


RESULTS = Path(__file__).resolve().parent / "results"
RUNS = RESULTS.parent / "runs"
GiB, MiB = 2**30, 2**20

# The checkpoint spec syntax (command line, JSON, CSV): one parser for every script.
SPEC_FORMS = ("None", *er.POLICIES, "every(k[, policy])", "nested(levels[, policy])")
SPEC_FORMS += (
    "recursive([policy])",
    "binomial(slots[, policy])",
    "ranges(n:spec, ...)",
)
_CALL = re.compile(r"(every|nested|recursive|binomial|ranges)\((.*)\)")
# The spelling that needs no shell quoting: `every:4`, `every:4:dots`, `recursive`.
_COLONS = re.compile(r"(every|nested|recursive|binomial)((?::[^:()]*)*)")


def parse_checkpoint(spec: str, depth: int | None = None) -> er.Checkpoint:
    """`"None"`, a policy name, a schedule as a call (`"every(4, dots)"`,
    `"recursive()"`) or with colons (`"every:4:dots"`, `"recursive"`), or layer
    ranges (`"ranges(4:dots, 12:every:3)"`). An integer may be `sqrt` or `log2`
    (of `depth`; inside `ranges`, of the range's count). Raises `ValueError`
    listing the accepted forms."""
    spec = spec.strip()
    colons = _COLONS.fullmatch(spec)
    if colons is not None:
        fn, rest = colons.groups()
        spec = f"{fn}({', '.join(rest.split(':')[1:])})"
    if spec in ("None", "none"):
        return None
    if spec in er.POLICIES:
        return spec
    match = _CALL.fullmatch(spec)
    if match is None:
        raise ValueError(
            f"unknown checkpoint {spec!r}. It needs to be one of: "
            f"{', '.join(SPEC_FORMS)} (or with colons: every:4:dots); an "
            "integer may be written sqrt or log2 (of the depth)."
        )
    fn, inner = match.groups()
    if fn == "ranges":
        return _ranges(inner, spec)
    args = [_argument(p.strip().strip("'\""), spec, depth) for p in inner.split(",")]
    try:
        return getattr(er, fn)(*[a for a in args if a != ""])
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {spec!r}: {e}") from None


def _ranges(inner: str, spec: str) -> er.ranges:
    """`ranges(n:spec, ...)`, split at the commas outside parentheses."""
    parts, level, start = [], 0, 0
    for i, ch in enumerate(inner + ","):
        level += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and level == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    pairs = []
    for part in parts:
        count, colon, sub = part.partition(":")
        if not colon or not count.strip().isdigit():
            raise ValueError(
                f"checkpoint {spec!r}: expected ranges(n:spec, ...), e.g. "
                f"ranges(4:dots, 12:None). Got {part!r}."
            )
        n = int(count)
        pairs.append((n, parse_checkpoint(sub, depth=n)))
    try:
        return er.ranges(*pairs)
    except ValueError as e:
        raise ValueError(f"checkpoint {spec!r}: {e}") from None


def _argument(part: str, spec: str, depth: int | None) -> Any:
    if part in ("", *er.POLICIES):
        return part
    if part in ("sqrt", "log2"):
        if depth is None:
            raise ValueError(f"checkpoint {spec!r} needs the depth of the stack.")
        if part == "sqrt":
            return max(1, round(math.sqrt(depth)))
        return max(1, math.ceil(math.log2(max(2, depth))))
    try:
        return int(part)
    except ValueError:
        raise ValueError(
            f"checkpoint {spec!r}: expected an integer, sqrt, log2 or one of "
            f"{', '.join(er.POLICIES)}. Got {part!r}."
        ) from None


def checkpoint_label(c: er.Checkpoint) -> str:
    """The spec of a checkpoint, as `parse_checkpoint` reads it back."""
    if c is None:
        return "None"
    if isinstance(c, str):
        return c
    if isinstance(c, er.ranges):
        return f"ranges({', '.join(f'{n}:{checkpoint_label(k)}' for n, k in c.parts)})"
    if isinstance(c, er.Schedule):
        parts = [
            str(getattr(c, f.name)) for f in dataclasses.fields(c) if f.name != "policy"
        ]
        if getattr(c, "policy", None) is not None:
            parts.append(str(c.policy))
        return f"{type(c).__name__}({', '.join(parts)})"
    return repr(c)


def _spec_type(spec: str) -> str:
    parse_checkpoint(spec, depth=16)  # syntax only: sqrt/log2 resolve per preset
    return spec


def parse_bytes(text: str) -> int:
    """`"16GiB"`, `"1.5GB"`, `"1000"` → bytes: the library's parser."""
    return er.parse_bytes(text, name="the size")


def _target_type(text: str) -> str:
    if er.internal.v5e_shape(text) is None:
        raise ValueError(f"expected v5e or v5e:AxB (e.g. v5e:2x4). Got {text!r}.")
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


def first_line(e: BaseException, limit: int = 300) -> str:
    """An error's first line (or its type's name)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


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
        set_main(not args.distributed)
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
                c = parse_checkpoint(spec, depth)
                if isinstance(c, er.Schedule):
                    c.check_depth(depth)
            except ValueError as e:
                return f"--checkpoint {spec} on {name} ({depth} layers): {e}"
    return None


def writable_problem(path: Path) -> str | None:
    """Why `path` cannot be a directory to write in, or `None`: tried (the missing
    directories made, a file written), then what was made removed again."""
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


def run_dir(script: str) -> Path:
    """A fresh `benchmarks/runs/<script>-<date>/`, so nothing is overwritten."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return RUNS / f"{script}-{stamp}"


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


_MAIN: list[bool] = []


def set_main(main: bool) -> None:
    """Whether this process prints and writes, where JAX is not initialised
    here (the measuring processes say)."""
    _MAIN[:] = [main]


def is_main() -> bool:
    return _MAIN[0] if _MAIN else _device.is_main_process()


def meta(
    args: argparse.Namespace, row: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    """What ran, where, with what (the device from a measured `row` where this
    process did not open it): every results file's `meta`."""
    if args.deferred:
        row = row or {}
        device = {
            "device": row.get("device_kind"),
            "device_count": row.get("device_count"),
        }
    else:
        device = {
            "device": _device.device_kind(),
            "device_count": jax.device_count(),
            # Several with --distributed: the figures are process 0's, of the
            # program every process ran together (memory per device).
            "process_count": jax.process_count(),
        }
    return {
        "command": shlex.join(["python", f"benchmarks/{args.script}.py", *args.argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "backend": args.platform,
        **device,
        "target": getattr(args, "target", None),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "versions": {
            n: _version(n)
            for n in ("jax", "jaxlib", "equinox", "flax", "libtpu", "eqx-remat")
        },
        **extra,
    }


def where(args: argparse.Namespace, data: dict[str, Any]) -> str:
    """For table titles: the device, or the compile-only target."""
    if getattr(args, "target", None):
        return f"TPU {args.target} per chip, compiled, not run"
    m = data["meta"]
    return f"{m['device']} x{m['device_count']}, run"


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Written whole or not at all (a temporary file, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(data), indent=1) + "\n")
    tmp.replace(path)


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys and not isinstance(r[k], list | dict)]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows({k: r.get(k) for k in keys} for r in rows)


def write(
    args: argparse.Namespace, stem: str, data: dict[str, Any], plot: Callable
) -> Path | None:
    """`<out>/<stem>.json` (with `meta`), `.csv` (of `data["rows"]`) and `.png`
    (`plot(data, path)`); only on process 0. Returns the JSON's path."""
    if not is_main():
        return None
    path = args.out / f"{stem}.json"
    write_json(path, data)
    write_csv(path.with_suffix(".csv"), data["rows"])
    plot(data, path.with_suffix(".png"))
    return path


def of_kind(rows: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The rows whose `kind` is `kind` (the sweeps' rows of several kinds)."""
    return [r for r in rows if r.get("kind") == kind]


def fmt_bytes(n: int | None, digits: int = 2) -> str:
    return "n/a" if n is None else er.format_bytes(n, digits=digits)


def fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def fmt_flops(n: int | float | None) -> str:
    return "n/a" if n is None else format_flops(n)


def fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def fmt_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1e3 * seconds:.3g} ms"


# `plan_sweep`'s rows, on the console and in markdown (`code`: "{}" or "`{}`").


def pick_cells(r: dict[str, Any], code: str) -> list[str]:
    """One pick, beside the best uniform candidate that fits."""
    return [
        r["group"],
        fmt_bytes(r["budget_bytes"]),
        code.format(r["checkpoint"]) if r["checkpoint"] else "nothing fits",
        fmt_bytes(r.get("compiled_bytes")),
        fmt_bytes(r.get("predicted_bytes")),
        fmt_ms(r.get("time_s")),
        code.format(r["best_uniform"]) if r["best_uniform"] else "-",
        fmt_ms(r["best_uniform_time_s"]),
    ]


TIMED_COLUMNS = ("preset", "checkpoint", "memory", "measured", "spread", "predicted")
TIMED_COLUMNS += ("roofline", "on the frontier")


def timed_cells(r: dict[str, Any], code: str, estimated: str) -> list[str]:
    """`TIMED_COLUMNS` of one timed row (`estimated` marks an estimate)."""
    return [
        r["group"],
        code.format(r["checkpoint"]),
        fmt_bytes(r["memory_bytes"]),
        fmt_ms(r["measured_s"]),
        fmt_pct(r["spread"]),
        fmt_ms(r["predicted_s"]) + ("" if r["predicted_measured"] else estimated),
        fmt_ms(r["roofline_s"]),
        "yes" if r["on_frontier"] else "",
    ]


WIDTH = 100  # the width of the tables when the output is not a terminal


def shown_columns(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[int]:
    """The indices of the columns not `n/a` (or empty) in every row."""
    return [
        i
        for i in range(len(columns))
        if not rows or any(str(r[i]) not in ("n/a", "") for r in rows)
    ]


class Console:
    """rich output that only process 0 prints (`WIDTH` wide off a terminal)."""

    def __init__(self) -> None:
        c = rich.console.Console()
        self.rich = c if c.is_terminal else rich.console.Console(width=WIDTH)

    def print(self, *objects: Any, **kw: Any) -> None:
        if is_main():
            self.rich.print(*objects, **kw)

    def table(
        self, title: str, columns: Sequence[str], rows: Sequence, left: int = 3
    ) -> None:
        """A compact table: no all-`n/a` columns, the first `left` columns
        left-aligned, labels never cut."""
        keep = shown_columns(columns, rows)
        t = rich.table.Table(
            title=escape(title),
            title_justify="left",
            box=rich.box.SIMPLE_HEAD,
            padding=(0, 1),
            pad_edge=False,
            collapse_padding=True,
        )
        for i in keep:
            label = max((len(str(r[i])) for r in rows), default=0) if i < left else 0
            justify = "left" if i < left else "right"
            width = min(label, 24) or None
            t.add_column(escape(columns[i]), justify=justify, min_width=width)
        for r in rows:
            t.add_row(*[escape(str(r[i])) for i in keep])
        self.print(t)

    @contextlib.contextmanager
    def progress(self, total: int) -> Iterator[Callable[[str], None]]:
        """A context manager giving `step(description)`, one bar per run."""
        columns = (
            rich.progress.TextColumn("{task.description:<50}"),
            rich.progress.BarColumn(),
            rich.progress.MofNCompleteColumn(),
            rich.progress.TimeElapsedColumn(),
        )
        bar = rich.progress.Progress(*columns, console=self.rich, disable=not is_main())
        with bar:
            task = bar.add_task("", total=total)

            def step(desc: str) -> None:
                bar.update(task, description=desc[:50])
                bar.advance(task)

            yield step


def plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def save_figure(fig: Any, path: Path, rect: tuple | None = None) -> None:
    """Lay out (within `rect`), write (110 dpi) and close: every plot's end."""
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=110)
    plt().close(fig)


def show_targets(console: "Console", targets: Sequence[dict[str, Any]]) -> None:
    """The target verdicts every measuring script ends with."""
    mark = {True: "met", False: "NOT met", None: "n/a"}
    rows = [
        (mark[t["met"]], t["name"], t["measured"], t.get("why", "")) for t in targets
    ]
    console.table("Targets", ("", "target", "measured", "note"), rows, left=4)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def where_compiled(data: dict[str, Any]) -> str:
    """For the tables of compile-only scripts."""
    return f"{data['meta']['device']}, compiled, not run"

"""Results files: where they go (`RESULTS`, a fresh `runs/` directory), what
every one records about the run (`meta`), and the one way they are written
(`write`: JSON, CSV, PNG) and read (`read`); only process 0 writes."""

import argparse
import csv
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from . import _device


RESULTS = Path(__file__).resolve().parent / "results"


RUNS = RESULTS.parent / "runs"


def stem(
    args: argparse.Namespace, name: str | None = None, quick: str = "-quick"
) -> str:
    """A results file's stem: `name` (default: `<script>-<device or target>`),
    with `quick` appended under `--quick`."""
    tag = (getattr(args, "target", None) or args.platform).replace(":", "_")
    return (name or f"{args.script}-{tag}") + (quick if args.quick else "")


def run_dir(script: str) -> Path:
    """A fresh `benchmarks/runs/<script>-<date>/`, so nothing is overwritten."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return RUNS / f"{script}-{stamp}"


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


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


def where_compiled(data: dict[str, Any]) -> str:
    """For the tables of compile-only scripts."""
    return f"{data['meta']['device']}, compiled, not run"


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
    args: argparse.Namespace,
    stem: str,
    data: dict[str, Any],
    plot: Callable | None,
) -> Path | None:
    """`<out>/<stem>.json` (with `meta`), `.csv` (of `data["rows"]`) and `.png`
    (`plot(data, path)`, unless `plot` is `None`); only on process 0. Returns
    the JSON's path."""
    if not _device.is_main():
        return None
    path = args.out / f"{stem}.json"
    write_json(path, data)
    write_csv(path.with_suffix(".csv"), data["rows"])
    if plot is not None:
        plot(data, path.with_suffix(".png"))
    return path


def read(path: Path) -> dict[str, Any]:
    """A results file as `write` wrote it (rows whole; each script reads its
    rows through its row type, `_table.read`)."""
    return json.loads(path.read_text())


def of_kind(rows: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The rows whose `kind` is `kind` (the sweeps' rows of several kinds)."""
    return [r for r in rows if r.get("kind") == kind]

"""Depth scaling: compiled memory, FLOPs and compile time of each schedule as the
ResidualChain grows from 64 to 4096 layers, with the log-log slope of memory
against D; `equinox.internal.scan`'s treeverse as a peer.

    python benchmarks/depth_scaling.py            # D = 64 ... 4096 (a few minutes)
    python benchmarks/depth_scaling.py --depths 64 256 1024 --width 128 --batch 4096
    python benchmarks/depth_scaling.py --quick    # tests
"""

import argparse
import dataclasses
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks import (
    _cli,
    _console,
    _depth,
    _ending,
    _format,
    _measure,
    _models,
    _results,
    _table,
)


CHECKPOINTS = _models.ChainPreset.CHECKPOINTS  # the sweep's chain checkpoints
DEPTHS = (64, 128, 256, 512, 1024, 2048, 4096)


def _parser() -> argparse.ArgumentParser:
    p = _depth.parser(__doc__, list(DEPTHS), "chain layers D")
    _cli.int_flag(p, "--width", 32, metavar=None)
    _cli.int_flag(p, "--batch", 256, metavar=None)
    p.add_argument(
        "--no-peers", action="store_true", help="no treeverse (default: off)"
    )
    return p


def slope(rows: list[dict], spec: str, lo: int) -> float | None:
    """The log-log slope of `spec`'s temp memory against depth, from depth `lo`."""
    pts = [
        (r["depth"], r["temp_bytes"])
        for r in rows
        if r["spec"] == spec and r["depth"] >= lo and r["temp_bytes"] > 0
    ]
    if len(pts) < 2:
        return None
    return float(np.polyfit(*np.log(np.array(pts, dtype=float)).T, 1)[0])


def main(argv: list[str] | None = None) -> dict:
    quick = {"depths": [16, 64], "width": 8, "batch": 2, "repeats": 1}
    args = _cli.parse_args(
        _parser(), argv, "depth_scaling", quick=quick, check=_depth.depth_problem
    )
    quick = ["None", "nested(2)", "recursive()"]
    specs = list(args.checkpoint or (quick if args.quick else CHECKPOINTS))
    specs += [] if args.no_peers else [None]

    def measure(point: tuple[int, str | None], first: bool) -> dict:
        """Compile one variant (`spec=None`: the treeverse peer) from scratch;
        the first time with its memory and FLOPs."""
        layers, spec = point
        preset = _models.ChainPreset(batch=args.batch, width=args.width, layers=layers)
        specs = [spec] if spec else []
        vs = _measure.variants("chain", preset, specs, peers=not spec)
        v = vs[0] if spec else next(v for v in vs if v.impl == "eqxi.scan")
        if first:
            jax.clear_caches()
            row, _ = _measure.compile_variant(v, None)
        else:
            row = {"compile_s": _depth.compile_seconds(*v.build())}
        return row | {
            "spec": spec or "treeverse(log2)",
            "depth": layers,
            "impl": v.impl,
            "checkpoint": v.checkpoint,
        }

    console, t0 = _console.Console(), time.perf_counter()
    points = {(d, s): f"D={d} {s or 'treeverse'}" for d in args.depths for s in specs}
    rows = _depth.sweep(console, args.repeats, points, measure, "compile_times_s")
    lo = sorted(args.depths)[len(args.depths) // 3]
    names = list(dict.fromkeys(r["spec"] for r in rows))
    describe = f"zoo.ResidualChain width {args.width}, batch {args.batch}, float32"
    data = {
        "meta": _results.meta(
            args, seconds=time.perf_counter() - t0, describe=describe
        ),
        "rows": rows,
        "memory_slopes": {
            "from_depth": lo,
            "slopes": {s: slope(rows, s, lo) for s in names},
        },
    }
    return _ending.finish(
        args,
        console,
        data,
        stem="depth_scaling" + "_quick" * args.quick,
        plot=plot,
        show=show,
    )


@dataclasses.dataclass(frozen=True)
class Row:
    """One point: a checkpoint (`spec`; the peer's `treeverse(log2)`) compiled
    at one depth (the fields the tables read)."""

    spec: str
    depth: int
    impl: str
    checkpoint: str  # as compiled (`sqrt`, `log2` resolved)
    compile_s: float  # the median
    compile_times_s: list[float]
    temp_bytes: int | None = None
    flops: int | None = None


def tables(data: dict) -> dict[str, tuple[list[_table.Column], list[_depth.Line]]]:
    """The script's tables, on the console and in report.py: title -> (its
    columns, its lines), one line per checkpoint, a column per depth."""
    rows = _table.read_all(Row, data["rows"])
    depths = sorted({r.depth for r in rows})
    lines = _depth.lines(rows, "spec", "depth")
    base = {r.depth: r.flops for r in rows if r.spec == "None"}
    slopes = data["memory_slopes"]["slopes"]

    def flops(r: Row) -> str:
        b = base.get(r.depth)
        return _format.fmt_ratio(r.flops / b if r.flops and b else None)

    def slope(line: _depth.Line) -> str:
        return "n/a" if slopes[line.spec] is None else f"{slopes[line.spec]:.2f}"

    memory = _depth.columns(
        depths,
        lambda r: _format.fmt_bytes(r.temp_bytes, digits=1),
        extra=[_table.Column("slope", slope)],
    )
    start = data["memory_slopes"]["from_depth"]
    return {
        f"Compiled temp memory, and the log-log slope from D = {start}": (
            memory,
            lines,
        ),
        "FLOPs vs None": (_depth.columns(depths, flops), lines),
        "Trace + lower + compile, seconds (median)": (
            _depth.columns(depths, lambda r: f"{r.compile_s:.1f}"),
            lines,
        ),
    }


def show(console: _console.Console, data: dict, where: str) -> None:
    console.print(data["meta"]["describe"])
    where = _results.where_compiled(data)
    for title, (columns, lines) in tables(data).items():
        _table.show(console, f"{title} [{where}]", columns, lines, left=1)


def report(data: dict) -> str:
    """report.py's section: what was measured, then each table."""
    parts = [f"{data['meta']['describe']}."]
    for title, (columns, lines) in tables(data).items():
        parts.append(f"{title}:\n\n{_table.markdown(columns, lines)}")
    return "\n\n".join(parts)


def plot(data: dict, path: Path) -> None:
    """Against depth, per checkpoint: compiled temp memory, FLOPs vs `None` and
    compile time (`_depth.plot`)."""
    _depth.plot(data, path)


if __name__ == "__main__":
    main()

"""Compile time against depth: the scanned transformer's training step at 4 and
64 layers, per checkpoint (the target: at most 1.5x under `None` and every
policy; `recursive()` and `binomial` trace O(log D) loops by design).

    python benchmarks/compile_time.py
    python benchmarks/compile_time.py --depths 4 16 64 --checkpoint None dots
    python benchmarks/compile_time.py --quick     # tests
"""

import argparse
import dataclasses
import time
from pathlib import Path

import eqx_remat as er
from benchmarks import (
    _cli,
    _console,
    _depth,
    _ending,
    _format,
    _models,
    _results,
    _table,
)


CHECKPOINTS = ("None", "dots", "nothing", "every(2)", "recursive()", "binomial(3)")
LIMIT = 1.5  # the target, for None and every policy


def _parser() -> argparse.ArgumentParser:
    p = _depth.parser(__doc__, [4, 64], "transformer layers")
    _cli.int_flag(p, "--d-model", 128, metavar=None)
    return p


def main(argv: list[str] | None = None) -> dict:
    quick = {"depths": [2, 8], "checkpoint": ["None"], "repeats": 1, "d_model": 32}
    args = _cli.parse_args(
        _parser(), argv, "compile_time", quick=quick, check=_depth.depth_problem
    )
    specs = args.checkpoint or CHECKPOINTS
    seq, batch = (16, 2) if args.quick else (128, 4)

    def preset(n: int) -> _models.TransformerPreset:
        heads = max(1, args.d_model // 32)
        return _models.TransformerPreset(
            batch=batch, seq=seq, d_model=args.d_model, heads=heads, layers=n
        )

    def measure(point: tuple[str, int], first: bool) -> dict:
        spec, n = point
        p = preset(n)
        checkpoint = er.parse_checkpoint(spec, p.depth)
        fn, params = _models.ours(p, p.build(abstract=True), checkpoint)
        seconds = _depth.compile_seconds(fn, params, p.inputs(abstract=True))
        return {"checkpoint": spec, "layers": n, "compile_s": seconds}

    console, t0 = _console.Console(), time.perf_counter()
    points = {(s, n): f"{s}, {n} layers" for s in specs for n in args.depths}
    rows = _depth.sweep(console, args.repeats, points, measure, "times_s")
    lo, hi = min(args.depths), max(args.depths)
    med = {(r["checkpoint"], r["layers"]): r["compile_s"] for r in rows}
    ratios = {s: med[(s, hi)] / med[(s, lo)] for s in specs}
    describe = preset(hi).describe().replace(f"{hi} layers", "N layers")
    data = {
        "meta": _results.meta(
            args, seconds=time.perf_counter() - t0, describe=describe
        ),
        "rows": rows,
        "ratio_deepest_to_shallowest": ratios,
        "targets": [target(ratios, lo, hi)],
    }
    return _ending.finish(
        args,
        console,
        data,
        stem="compile_time" + "_quick" * args.quick,
        plot=plot,
        show=show,
    )


@dataclasses.dataclass(frozen=True)
class Row:
    """One point: a checkpoint's training step compiled at one depth."""

    checkpoint: str
    layers: int
    compile_s: float  # the median
    times_s: list[float]


def columns(data: dict) -> tuple[list[_table.Column], list[_depth.Line]]:
    """The table, on the console and in report.py: a line per checkpoint, the
    median compile time at each depth, and deepest / shallowest."""
    rows = _table.read_all(Row, data["rows"])
    layers = sorted({r.layers for r in rows})
    ratios = data["ratio_deepest_to_shallowest"]
    ratio = _table.Column(
        f"{layers[-1]} / {layers[0]}",
        lambda line: _format.fmt_ratio(ratios[line.spec]),
    )
    cols = _depth.columns(
        layers, lambda r: f"{r.compile_s:.2f}", "{} layers (s)", [ratio]
    )
    return cols, _depth.lines(rows, "checkpoint", "layers")


def show(console: _console.Console, data: dict, where: str) -> None:
    console.print(data["meta"]["describe"])
    title = f"Compile time, s (median) [{_results.where_compiled(data)}]"
    _table.show(console, title, *columns(data), left=1)


def report(data: dict) -> str:
    """report.py's section: what was compiled, the table, the target."""
    table = _table.markdown(*columns(data))
    targets = _table.targets_markdown(data)
    return f"{data['meta']['describe']}\n\n{table}\n\n{targets}"


def target(ratios: dict[str, float], lo: int, hi: int) -> dict:
    """The verdict: compile time at `hi` layers over `lo` layers, at most `LIMIT`
    for `None` and every policy (schedules may grow by design)."""
    policies = [
        x
        for s, x in ratios.items()
        if isinstance(er.parse_checkpoint(s, hi), str | None)
    ]
    return {
        "name": f"compile time at {hi} layers <= {LIMIT}x at {lo} layers "
        "(None and every policy)",
        "metric": "compile_s",
        "threshold": LIMIT,
        "value": max(policies, default=None),
        "met": all(x <= LIMIT for x in policies) if policies else None,
        "measured": ", ".join(f"{s} {x:.2f}x" for s, x in ratios.items()),
        "why": "recursive/binomial trace O(log D) loops by design",
    }


def plot(data: dict, path: Path) -> None:
    """`_depth.plot`'s compile-time panel, per checkpoint against depth."""
    keys = {"checkpoint": "spec", "layers": "depth", "times_s": "compile_times_s"}
    rows = [{keys.get(k, k): v for k, v in r.items()} for r in data["rows"]]
    what = "Compile time of a training step against depth, per checkpoint"
    _depth.plot(data | {"rows": rows}, path, f"{what}: {data['meta']['describe']}")


if __name__ == "__main__":
    main()

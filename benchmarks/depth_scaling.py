"""Depth scaling: compiled memory, FLOPs and compile time of each schedule as the
ResidualChain grows from 64 to 4096 layers, with the log-log slope of memory
against D; `equinox.internal.scan`'s treeverse as a peer.

    python benchmarks/depth_scaling.py            # D = 64 ... 4096 (a few minutes)
    python benchmarks/depth_scaling.py --depths 64 256 1024 --width 128 --batch 4096
    python benchmarks/depth_scaling.py --quick    # tests
"""

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from benchmarks import _common, _measure, _models, _plots


CHECKPOINTS = _models.ChainPreset.CHECKPOINTS  # the sweep's chain checkpoints
DEPTHS = (64, 128, 256, 512, 1024, 2048, 4096)


def parser(doc: str, depths: list[int], what: str) -> argparse.ArgumentParser:
    """The flags of both compile-time scripts: `--depths` (of `what`)."""
    p = _common.parser(doc, repeats=3, target=False)
    _common.int_flag(p, "--depths", depths, f"the depths to measure: {what}", nargs="+")
    return p


def _parser() -> argparse.ArgumentParser:
    p = parser(__doc__, list(DEPTHS), "chain layers D")
    _common.int_flag(p, "--width", 32, metavar=None)
    _common.int_flag(p, "--batch", 256, metavar=None)
    p.add_argument(
        "--no-peers", action="store_true", help="no treeverse (default: off)"
    )
    return p


def compile_seconds(fn: Callable, *args) -> float:
    """Trace, lower and compile `fn` from scratch (caches cleared first)."""
    jax.clear_caches()
    t0 = time.perf_counter()
    jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - t0


def sweep(
    console: _common.Console,
    repeats: int,
    points: dict,
    measure: Callable[[tuple, bool], dict],
    times: str,
) -> list[dict]:
    """`measure(point, first)` (a row with `compile_s`) for each point (a key of
    `points`, whose value names it), `repeats` rounds interleaved so that the
    machine's load hits every point alike. One row per point: the first round's,
    with the median `compile_s` and the samples under `times`."""
    results: dict = {}
    with console.progress(repeats * len(points)) as step:
        for r in range(repeats):
            for point, name in points.items():
                step(f"round {r + 1}: {name}")
                results.setdefault(point, []).append(measure(point, r == 0))
    rows = []
    for got in results.values():
        secs = [r["compile_s"] for r in got]
        rows.append(got[0] | {times: secs, "compile_s": statistics.median(secs)})
    return rows


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


def depth_problem(args) -> str | None:
    """`--checkpoint` at each of `--depths`."""
    depths = {f"--depths {n}": n for n in args.depths}
    return _common.depth_problem(args.checkpoint, depths)


def main(argv: list[str] | None = None) -> dict:
    quick = {"depths": [16, 64], "width": 8, "batch": 2, "repeats": 1}
    args = _common.parse_args(
        _parser(), argv, "depth_scaling", quick=quick, check=depth_problem
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
            row, _, _ = _measure.compile_variant(v, None)
        else:
            row = {"compile_s": compile_seconds(*v.build())}
        return row | {
            "spec": spec or "treeverse(log2)",
            "depth": layers,
            "impl": v.impl,
            "checkpoint": v.checkpoint,
        }

    console, t0 = _common.Console(), time.perf_counter()
    points = {(d, s): f"D={d} {s or 'treeverse'}" for d in args.depths for s in specs}
    rows = sweep(console, args.repeats, points, measure, "compile_times_s")
    lo = sorted(args.depths)[len(args.depths) // 3]
    names = list(dict.fromkeys(r["spec"] for r in rows))
    describe = f"zoo.ResidualChain width {args.width}, batch {args.batch}, float32"
    data = {
        "meta": _common.meta(args, seconds=time.perf_counter() - t0, describe=describe),
        "rows": rows,
        "memory_slopes": {
            "from_depth": lo,
            "slopes": {s: slope(rows, s, lo) for s in names},
        },
    }
    path = _common.write(args, "depth_scaling" + "_quick" * args.quick, data, plot)
    show(console, data, names)
    console.print(f"{len(rows)} points; results in {path}")
    return data


def show(console: _common.Console, data: dict, names: list[str]) -> None:
    depths = sorted({r["depth"] for r in data["rows"]})
    by = {(r["spec"], r["depth"]): r for r in data["rows"]}
    slopes = data["memory_slopes"]["slopes"]

    def flops(r: dict) -> str:
        base = by.get(("None", r["depth"]), {}).get("flops")
        return _common.fmt_ratio(r["flops"] / base if r["flops"] and base else None)

    tables = {  # title: each cell's text
        "Temp memory vs depth": lambda r: _common.fmt_bytes(r["temp_bytes"], digits=1),
        "FLOPs vs None": flops,
        "Compile time, s (median)": lambda r: f"{r['compile_s']:.1f}",
    }
    console.print(data["meta"]["describe"])
    for i, (title, cell) in enumerate(tables.items()):
        rows = [[s, *(cell(by[(s, d)]) for d in depths)] for s in names]
        cols = ["checkpoint", *(f"D={d}" for d in depths)]
        if i == 0:  # memory, with its slope
            cols.append("slope")
            for s, row in zip(names, rows):
                row.append("n/a" if slopes[s] is None else f"{slopes[s]:.2f}")
        title += f" [{_common.where_compiled(data)}]"
        console.table(title, cols, rows, left=1)


def plot(data: dict, path: Path, what: str = "") -> None:
    """Against depth, per checkpoint (`spec`): compiled temp memory (its axis log
    where the range calls for it) and FLOPs relative to `None`, where the rows
    have them, and compile time (bars: the spread of `compile_times_s`). `what`:
    the title (default: this script's)."""
    from matplotlib.ticker import FuncFormatter

    rows = data["rows"]
    by_spec: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["depth"]):
        by_spec.setdefault(r["spec"], []).append(r)
    base = {r["depth"]: r.get("flops") for r in by_spec.get("None", [])}
    panels = {  # y label: the value of a row (none: not drawn)
        "compiled temp memory (MiB)": lambda r: r["temp_bytes"] / _common.MiB,
        "FLOPs per step vs None": lambda r: (
            r["flops"] and r["flops"] / base[r["depth"]]
        ),
        "trace + lower + compile (s)": lambda r: r["compile_s"],
    }
    if "temp_bytes" not in rows[0]:
        panels = {k: v for k, v in panels.items() if k.startswith("trace")}
    hidden = {  # curves that another hides: said in the legend
        word: _plots.coinciding(
            {s: [r.get(k) for r in rs] for s, rs in by_spec.items()}
        )
        for word, k in (("memory", "temp_bytes"), ("FLOPs", "flops"))
        if k in rows[0]
    }
    fig, axes = _common.plt().subplots(
        1, len(panels), figsize=(max(7.5, 5 * len(panels)), 5), squeeze=False
    )
    for ax, (label, value) in zip(axes[0], panels.items()):
        for spec, rs in by_spec.items():
            rs = [r for r in rs if value(r)]
            notes = [f"{w} as {h[spec]}" for w, h in hidden.items() if spec in h]
            bars = [_plots.spread(r["compile_times_s"], r["compile_s"], 1) for r in rs]
            ax.errorbar(
                [r["depth"] for r in rs],
                [value(r) for r in rs],
                yerr=np.transpose(bars) if label.startswith("trace") else None,
                marker="o",
                capsize=2,
                elinewidth=0.8,
                label=spec + (f" ({', '.join(notes)}: hidden)" if notes else ""),
            )
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set(xlabel="depth D (layers)", ylabel=label)
        ax.grid(alpha=0.3, which="both")
        if label.startswith("compiled"):
            _plots.scale_for(ax, "y", [value(r) for r in rows])
        else:
            ax.set_ylim(bottom=0)
    handles = axes[0][0].get_legend_handles_labels()
    fig.legend(
        *handles, loc="lower center", ncols=4 if len(panels) > 1 else 3, fontsize=9
    )
    meta, n = data["meta"], max(len(r["compile_times_s"]) for r in rows)
    what = what or (
        f"Gradient of a deep {meta['describe']} against its depth D, per checkpoint: "
        "memory, recomputation and compile time"
    )
    _plots.suptitle(
        fig,
        f"{what} (median; bars: {_plots.spread_name(n, 'compiles')})\n"
        f"{meta['device']}, {meta['cpu_count']} cores, jax {meta['versions']['jax']}, "
        f"{meta['date']}",
    )
    _common.save_figure(fig, path, rect=(0, 0.07, 1, 1))


if __name__ == "__main__":
    main()

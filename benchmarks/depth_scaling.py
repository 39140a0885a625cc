"""Depth scaling: memory, FLOPs and compile time of each schedule as the
ResidualChain grows from 64 to 4096 layers.

`zoo.ResidualChain(width, D)` (per example, vmapped over the batch): the gradient
of `mean(chain(x)²)` is compiled (nothing runs) under `None` and `"nothing"`
(O(D) memory), `every(sqrt)` and `nested(2)` (O(√D)), `nested(3)` (O(D^⅓)),
`recursive()` and `binomial(log2)` (O(log D)), and, as a peer,
`equinox.internal.scan(kind="checkpointed", checkpoints=⌈log₂ D⌉)` (online
treeverse). Per D: compiled temp memory, FLOPs (`eqx_remat.count_flops`;
treeverse's loops have run-time trip counts, so it has none) and the time to
trace, lower and compile (median of `--repeats`, caches cleared before each,
interleaved); the table gives each schedule's log-log slope of memory against D.
`compile_time.py` is the same loop over the scanned transformer's depth.

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


def interleaved(console, repeats: int, points: dict, measure: Callable) -> dict:
    """`measure(point, first)` for every point (a key of `points`, whose value
    names it), `repeats` rounds, interleaved so that the machine's load hits
    every point alike: {point: [results]}."""
    out: dict = {}
    with console.progress(repeats * len(points)) as step:
        for r in range(repeats):
            for point, name in points.items():
                step(f"round {r + 1}: {name}")
                out.setdefault(point, []).append(measure(point, r == 0))
    return out


def one(preset: _models.ChainPreset, spec: str | None, first: bool) -> dict:
    """Compile one variant (`spec=None`: the treeverse peer) from scratch; the
    first time with its memory and FLOPs."""
    vs = _measure.variants(
        "chain",
        preset,
        [spec] if spec else [],
        target=None,
        peers=spec is None,
        quick=False,
    )
    v = vs[0] if spec else next(v for v in vs if v.impl == "eqxi.scan")
    if first:
        jax.clear_caches()
        row, _, _ = _measure.compile_variant(v, None)
    else:
        row = {"compile_s": compile_seconds(*v.build())}
    return row | {
        "spec": spec or "treeverse(log2)",
        "depth": preset.depth,
        "impl": v.impl,
        "checkpoint": v.checkpoint,
    }


def slope(rows: list[dict], spec: str, lo: int) -> float | None:
    pts = [
        (r["depth"], r["temp_bytes"])
        for r in rows
        if r["spec"] == spec and r["depth"] >= lo and r["temp_bytes"] > 0
    ]
    if len(pts) < 2:
        return None
    return float(np.polyfit(*np.log(np.array(pts, dtype=float)).T, 1)[0])


def main(argv: list[str] | None = None) -> dict:
    args = _common.parse_args(_parser(), argv, "depth_scaling")
    if args.quick:
        args.depths, args.width, args.batch, args.repeats = [16, 64], 8, 2, 1
    quick = ["None", "nested(2)", "recursive()"]
    specs = list(args.checkpoint or (quick if args.quick else CHECKPOINTS))
    specs += [] if args.no_peers else [None]

    def measure(point: tuple, first: bool) -> dict:
        preset = _models.ChainPreset(
            batch=args.batch, width=args.width, layers=point[0]
        )
        return one(preset, point[1], first)

    console, t0 = _common.Console(), time.perf_counter()
    points = {(d, s): f"D={d} {s or 'treeverse'}" for d in args.depths for s in specs}
    rows = []
    for results in interleaved(console, args.repeats, points, measure).values():
        times = [r["compile_s"] for r in results]
        rows.append(
            results[0]
            | {"compile_times_s": times, "compile_s": statistics.median(times)}
        )
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
    cols = ["checkpoint", *(f"D={d}" for d in depths)]

    def flops(s: str, d: int) -> str:
        base = by.get(("None", d), {}).get("flops")
        x = by[(s, d)]["flops"]
        return _common.fmt_ratio(x / base if x and base else None)

    def memory(s: str) -> list[str]:
        cells = [_common.fmt_bytes(by[(s, d)]["temp_bytes"], digits=1) for d in depths]
        return [s, *cells, "n/a" if slopes[s] is None else f"{slopes[s]:.2f}"]

    console.print(data["meta"]["describe"])
    title = f"[{_common.where_compiled(data)}]"
    tables = (
        ("Temp memory vs depth", [*cols, "slope"], [memory(s) for s in names]),
        ("FLOPs vs None", cols, [[s, *(flops(s, d) for d in depths)] for s in names]),
        (
            "Compile time, s (median)",
            cols,
            [[s, *(f"{by[(s, d)]['compile_s']:.1f}" for d in depths)] for s in names],
        ),
    )
    for what, columns, rows in tables:
        console.table(f"{what} {title}", columns, rows, left=1)


def plot(data: dict, path: Path) -> None:
    """Against D: compiled temp memory (log-log), FLOPs relative to `None` and
    compile time (with the fastest and slowest of its samples)."""
    from matplotlib.ticker import FuncFormatter

    pyplot = _common.plt()
    fig, axes = pyplot.subplots(1, 3, figsize=(15, 5))
    base = {r["depth"]: r.get("flops") for r in data["rows"] if r["spec"] == "None"}
    specs = list(dict.fromkeys(r["spec"] for r in data["rows"]))
    by_spec = {
        s: sorted((r["depth"], r) for r in data["rows"] if r["spec"] == s)
        for s in specs
    }
    hidden = {  # curves that another hides: said in the legend
        what: _plots.coinciding(
            {s: [r.get(key) for _, r in pts] for s, pts in by_spec.items()}
        )
        for what, key in (("memory", "temp_bytes"), ("FLOPs", "flops"))
    }
    for spec in specs:
        pts = by_spec[spec]
        ds = [d for d, _ in pts]
        notes = [f"{w} as {h[spec]}" for w, h in hidden.items() if spec in h]
        label = spec + (f" ({', '.join(notes)}: hidden)" if notes else "")
        mib = [r["temp_bytes"] / _common.MiB for _, r in pts]
        axes[0].plot(ds, mib, marker="o", label=label)
        fl = [(d, r["flops"] / base[d]) for d, r in pts if r.get("flops")]
        axes[1].plot(*zip(*fl) if fl else ([], []), marker="o")
        secs = [r["compile_s"] for _, r in pts]
        bars = [
            _plots.spread(r.get("compile_times_s") or [s], s, 1.0)
            for (_, r), s in zip(pts, secs)
        ]
        axes[2].errorbar(
            ds, secs, yerr=np.transpose(bars), marker="o", capsize=2, elinewidth=0.8
        )
    n = max(len(r.get("compile_times_s") or ()) for r in data["rows"])
    labels = ("compiled temp memory (MiB)", "FLOPs per step vs None")
    for ax, label in zip(axes, (*labels, "trace + lower + compile (s)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set(xlabel="depth D (layers)", ylabel=label)
        ax.grid(alpha=0.3, which="both")
    mib = [r["temp_bytes"] / _common.MiB for r in data["rows"]]
    _plots.scale_for(axes[0], "y", mib)
    axes[1].set_ylim(bottom=0)
    axes[2].set_ylim(bottom=0)
    handles = axes[0].get_legend_handles_labels()
    fig.legend(*handles, loc="lower center", ncols=4, fontsize=9)
    meta = data["meta"]
    _plots.suptitle(
        fig,
        f"Gradient of a deep {meta['describe']} against its depth D, per "
        f"checkpoint: memory, recomputation and compile time (median; bars: "
        f"{_plots.spread_name(n, 'compiles')})\n{meta['device']}, "
        f"{meta['cpu_count']} cores, jax {meta['versions']['jax']}, {meta['date']}",
    )
    _common.save_figure(fig, path, rect=(0, 0.07, 1, 1))


if __name__ == "__main__":
    main()

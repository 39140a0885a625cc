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

    python benchmarks/depth_scaling.py            # D = 64 ... 4096 (a few minutes)
    python benchmarks/depth_scaling.py --depths 64 256 1024 --width 128 --batch 4096
    python benchmarks/depth_scaling.py --quick    # tests
"""

import argparse
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks import _common, _measure, _models, _plots


CHECKPOINTS = _models.ChainPreset.CHECKPOINTS  # the sweep's chain checkpoints
DEPTHS = (64, 128, 256, 512, 1024, 2048, 4096)


def _parser() -> argparse.ArgumentParser:
    p = _common.parser(__doc__, repeats=3, target=False)
    p.add_argument(
        "--depths",
        type=_common.positive_int,
        nargs="+",
        default=list(DEPTHS),
        metavar="N",
        help="the depths to measure: chain layers D (default: %(default)s)",
    )
    p.add_argument(
        "--width", type=_common.positive_int, default=32, help="(default: %(default)s)"
    )
    p.add_argument(
        "--batch", type=_common.positive_int, default=256, help="(default: %(default)s)"
    )
    p.add_argument(
        "--no-peers", action="store_true", help="no treeverse (default: off)"
    )
    return p


def one(preset: _models.ChainPreset, spec: str | None, first: bool) -> dict:
    """Compile one variant (`spec=None`: the treeverse peer) from scratch."""
    vs = _measure.variants(
        "chain",
        preset,
        [spec] if spec else [],
        target=None,
        peers=spec is None,
        quick=False,
    )
    v = vs[0] if spec else next(v for v in vs if v.impl == "eqxi.scan")
    jax.clear_caches()
    if first:
        row, _, _ = _measure.compile_variant(v, None)
    else:
        fn, args = v.build()
        t0 = time.perf_counter()
        jax.jit(fn).lower(*args).compile()
        row = {"compile_s": time.perf_counter() - t0}
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
    specs = list(
        args.checkpoint
        or (["None", "nested(2)", "recursive()"] if args.quick else CHECKPOINTS)
    )
    specs += [] if args.no_peers else [None]
    console, rows, t0 = _common.Console(), {}, time.perf_counter()
    with console.progress(args.repeats * len(args.depths) * len(specs)) as step:
        for r in range(args.repeats):  # interleaved, so load hits every point alike
            for d in args.depths:
                preset = _models.ChainPreset(
                    batch=args.batch, width=args.width, layers=d
                )
                for spec in specs:
                    step(f"round {r + 1}: D={d} {spec or 'treeverse'}")
                    row = one(preset, spec, first=r == 0)
                    rows.setdefault((d, row["spec"]), row | {"compile_times_s": []})
                    rows[(d, row["spec"])]["compile_times_s"].append(row["compile_s"])
    rows = list(rows.values())
    for row in rows:
        row["compile_s"] = statistics.median(row["compile_times_s"])
    lo = sorted(args.depths)[len(args.depths) // 3]
    names = list(dict.fromkeys(r["spec"] for r in rows))
    data = {
        "meta": _common.meta(
            args,
            seconds=time.perf_counter() - t0,
            describe=f"zoo.ResidualChain width {args.width}, batch "
            f"{args.batch}, float32",
        ),
        "rows": rows,
        "memory_slopes": {
            "from_depth": lo,
            "slopes": {s: slope(rows, s, lo) for s in names},
        },
    }
    stem = "depth_scaling" + ("_quick" if args.quick else "")
    path = _common.write(args, stem, data, plot)
    show(console, data, names)
    console.print(f"{len(rows)} points; results in {path}")
    return data


def show(console: _common.Console, data: dict, names: list[str]) -> None:
    depths = sorted({r["depth"] for r in data["rows"]})
    by = {(r["spec"], r["depth"]): r for r in data["rows"]}
    slopes = data["memory_slopes"]["slopes"]
    cols = ["checkpoint", *(f"D={d}" for d in depths)]
    console.print(data["meta"]["describe"])
    title = f"[{_common.where_compiled(data)}]"
    console.table(
        f"Temp memory vs depth {title}",
        [*cols, "slope"],
        [
            [
                s,
                *(
                    _common.fmt_bytes(by[(s, d)]["temp_bytes"], digits=1)
                    for d in depths
                ),
                "n/a" if slopes[s] is None else f"{slopes[s]:.2f}",
            ]
            for s in names
        ],
        left=1,
    )
    console.table(
        f"FLOPs vs None {title}",
        cols,
        [
            [
                s,
                *(
                    _common.fmt_ratio(
                        by[(s, d)]["flops"] / by[("None", d)]["flops"]
                        if by[(s, d)]["flops"] and ("None", d) in by
                        else None
                    )
                    for d in depths
                ),
            ]
            for s in names
        ],
        left=1,
    )
    console.table(
        f"Compile time, s (median) {title}",
        cols,
        [[s, *(f"{by[(s, d)]['compile_s']:.1f}" for d in depths)] for s in names],
        left=1,
    )


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
    # Curves that another hides: said in the legend.
    hidden_memory = _plots.coinciding(
        {s: [r["temp_bytes"] for _, r in pts] for s, pts in by_spec.items()}
    )
    hidden_flops = _plots.coinciding(
        {s: [r.get("flops") for _, r in pts] for s, pts in by_spec.items()}
    )
    for spec in specs:
        pts = by_spec[spec]
        ds = [d for d, _ in pts]
        notes = [
            f"{what} as {hidden[spec]}"
            for what, hidden in (("memory", hidden_memory), ("FLOPs", hidden_flops))
            if spec in hidden
        ]
        label = spec + (f" ({', '.join(notes)}: hidden)" if notes else "")
        axes[0].plot(
            ds, [r["temp_bytes"] / _common.MiB for _, r in pts], marker="o", label=label
        )
        fl = [(d, r["flops"] / base[d]) for d, r in pts if r.get("flops")]
        axes[1].plot(*zip(*fl) if fl else ([], []), marker="o")
        times = [r.get("compile_times_s") or [r["compile_s"]] for _, r in pts]
        secs = [r["compile_s"] for _, r in pts]
        bars = [_plots.spread(ts, s, 1.0) for ts, s in zip(times, secs)]
        axes[2].errorbar(
            ds, secs, yerr=np.transpose(bars), marker="o", capsize=2, elinewidth=0.8
        )
    n = max(len(r.get("compile_times_s") or ()) for r in data["rows"])
    for ax, label in zip(
        axes,
        (
            "compiled temp memory (MiB)",
            "FLOPs per step vs None",
            "trace + lower + compile (s)",
        ),
    ):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set(xlabel="depth D (layers)", ylabel=label)
        ax.grid(alpha=0.3, which="both")
    _plots.scale_for(
        axes[0], "y", [r["temp_bytes"] / _common.MiB for r in data["rows"]]
    )
    axes[1].set_ylim(bottom=0)
    axes[2].set_ylim(bottom=0)
    fig.legend(
        *axes[0].get_legend_handles_labels(), loc="lower center", ncols=4, fontsize=9
    )
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

"""Depth scaling: memory, FLOPs and compile time of each schedule as the
ResidualChain grows from 64 to 4096 layers.

`zoo.ResidualChain(width, D)` (per example, vmapped over the batch): the gradient
of `mean(chain(x)²)` is compiled (nothing runs) on the CPU under

- `None` and `"nothing"` (plain remat: each layer checkpointed): O(D) memory;
- `every(√D)` and `nested(2)`: O(√D); `nested(3)`: O(D^(1/3));
- `recursive()` and `binomial(⌈log₂ D⌉)`: O(log D);
- and, as a peer, `equinox.internal.scan(kind="checkpointed",
  checkpoints=⌈log₂ D⌉)` (online treeverse).

Reported per D: compiled temp memory, FLOPs (`eqx_remat.count_flops`; binomial
counted exactly by `eqx_remat.plan`; treeverse's loops have run-time trip counts,
so it has none), and the time to trace, lower and compile (median of
`--repeats`, caches cleared before each). The plot puts memory
and FLOPs against D on log-log axes beside O(D), O(√D) and O(log D) reference
slopes, and compile time against D; the table gives each schedule's fitted
log-log slope of memory against D.

    python benchmarks/depth_scaling.py            # D = 64 ... 4096 (a few minutes)
    python benchmarks/depth_scaling.py --depths 64 256 1024 --width 64
    python benchmarks/depth_scaling.py --quick    # tests
"""

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path


os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _models as M  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import eqx_remat as er  # noqa: E402


SCHEDULES = (
    "None",
    "nothing",
    "every(sqrt)",
    "nested(2)",
    "nested(3)",
    "recursive()",
    "binomial(log2)",
)
TREEVERSE = "treeverse(log2)"
DEPTHS = (64, 128, 256, 512, 1024, 2048, 4096)


def measure_one(preset, spec: str, first: bool = True) -> dict:
    """Compile the gradient of a chain of `preset.depth` layers under `spec`;
    with `first`, also its memory and FLOPs."""
    model = M.build(preset, abstract=True)
    x = M.batch(preset, abstract=True)
    log2 = max(1, math.ceil(math.log2(max(2, preset.depth))))
    if spec == TREEVERSE:
        fn, params = M.treeverse_chain(preset, model, log2)
        label = f"treeverse({log2})"
        c = None
    else:
        c = C.parse_checkpoint(spec, preset.depth)
        fn, params = M.ours(preset, model, c)
        label = C.checkpoint_label(c)
    jax.clear_caches()
    compiled, secs = C.compile_fn(fn, (params, x))
    row = {"schedule": spec, "checkpoint": label, "depth": preset.depth}
    row["compile_s"] = secs
    if not first:
        return row
    row.update(C.memory_of(compiled))
    del compiled
    if isinstance(c, er.binomial):
        res = er.plan(
            eqx.filter_value_and_grad(M.loss_fn(preset)),
            er.set_checkpoint(model, c),
            x,
            budget_bytes=2**62,
            candidates=[c],
        )
        row["flops"] = int(res.entry.flops)
    else:
        f = er.count_flops(fn, params, x)
        row["flops"] = None if f.dynamic_loops else int(f)
    return row


def slope(rows, spec: str, lo: int) -> float | None:
    pts = [(r["depth"], r["temp_bytes"]) for r in rows if r["schedule"] == spec]
    pts = [(d, m) for d, m in pts if d >= lo and m > 0]
    if len(pts) < 2:
        return None
    d, m = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(d, m, 1)[0])


def plot(rows, path: Path, title: str) -> None:
    pyplot = C.plt()
    specs = list(dict.fromkeys(r["schedule"] for r in rows))
    fig, axes = pyplot.subplots(1, 3, figsize=(18, 5))
    depths = sorted({r["depth"] for r in rows})
    for spec in specs:
        pts = sorted((r["depth"], r) for r in rows if r["schedule"] == spec)
        ds = [d for d, _ in pts]
        style = "--" if spec == TREEVERSE else "-"
        axes[0].loglog(
            ds, [r["temp_bytes"] / C.MiB for _, r in pts], style, marker="o", label=spec
        )
        fl = [(d, r["flops"]) for d, r in pts if r["flops"] is not None]
        if fl:
            axes[1].loglog(
                [d for d, _ in fl],
                [f / 1e9 for _, f in fl],
                style,
                marker="o",
                label=spec,
            )
        axes[2].semilogx(
            ds, [r["compile_s"] for _, r in pts], style, marker="o", label=spec
        )
    # Reference slopes, anchored at the smallest depth.
    d0 = depths[0]
    ref = np.array(depths, dtype=float)
    lo = min(r["temp_bytes"] for r in rows if r["depth"] == d0) / C.MiB
    hi = max(r["temp_bytes"] for r in rows if r["depth"] == d0) / C.MiB
    for f, name, anchor in (
        (ref / d0, "O(D)", hi),
        (np.sqrt(ref / d0), "O(√D)", math.sqrt(hi * lo)),
        (np.log2(ref) / math.log2(d0), "O(log D)", lo),
    ):
        axes[0].loglog(ref, anchor * f, ":", color="gray", lw=1.5)
        axes[0].text(
            ref[-1],
            anchor * f[-1],
            name,
            fontsize=8,
            color="gray",
            ha="right",
            va="bottom",
        )
    f0 = min(r["flops"] for r in rows if r["depth"] == d0 and r["flops"]) / 1e9
    for f, name in (
        (ref / d0, "O(D)"),
        (ref / d0 * np.log2(ref) / math.log2(d0), "O(D log D)"),
    ):
        axes[1].loglog(ref, f0 * f, ":", color="gray", lw=1.5)
        axes[1].text(
            ref[-1], f0 * f[-1], name, fontsize=8, color="gray", ha="right", va="bottom"
        )
    axes[0].set_ylabel("compiled temp memory (MiB)")
    axes[1].set_ylabel("GFLOPs per step (count_flops)")
    axes[2].set_ylabel("trace + lower + compile (s)")
    for ax in axes:
        ax.set_xlabel("depth D (layers)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS))
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--schedules", nargs="+", default=[*SCHEDULES, TREEVERSE])
    p.add_argument("--repeats", type=int, default=3, help="compiles per point")
    p.add_argument("--quick", action="store_true", help="tiny (tests)")
    p.add_argument("--out", type=Path, default=C.RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.depths, args.width, args.batch, args.repeats = [16, 64], 8, 2, 1
        args.schedules = ["None", "nested(2)", "recursive()", TREEVERSE]
    console = C.console()
    from rich.progress import Progress

    rows: dict[tuple[int, str], dict] = {}
    t0 = time.perf_counter()
    with Progress(console=console) as prog:
        n = len(args.depths) * len(args.schedules)
        task = prog.add_task("", total=n * args.repeats)
        # Repeats interleaved (all depths and schedules, then again), so that
        # load from elsewhere spreads over every compile time alike.
        for r in range(args.repeats):
            for d in args.depths:
                preset = M.ChainPreset(args.width, d, args.batch)
                for spec in args.schedules:
                    prog.update(task, description=f"round {r + 1}: D={d} {spec}")
                    row = measure_one(preset, spec, first=r == 0)
                    if r == 0:
                        row["compile_times_s"] = []
                        rows[(d, spec)] = row
                    rows[(d, spec)]["compile_times_s"].append(row["compile_s"])
                    prog.advance(task)
    rows = list(rows.values())
    for row in rows:
        row["compile_s"] = statistics.median(row["compile_times_s"])
    elapsed = time.perf_counter() - t0

    lo = sorted(args.depths)[len(args.depths) // 3]
    slopes = {s: slope(rows, s, lo) for s in args.schedules}
    stem = "depth_scaling" + ("_quick" if args.quick else "")
    describe = f"zoo.ResidualChain width {args.width}, batch {args.batch}, float32"
    data = {
        "meta": C.meta(argv, seconds=elapsed, describe=describe),
        "rows": rows,
        "memory_slopes": {"from_depth": lo, "slopes": slopes},
    }
    C.write_json(args.out / f"{stem}.json", data)
    C.write_csv(args.out / f"{stem}.csv", rows)
    cmd = "python benchmarks/depth_scaling.py " + " ".join(argv or sys.argv[1:])
    plot(rows, args.out / f"{stem}.png", f"{describe} — {cmd.strip()} [CPU]")

    depths = sorted(args.depths)
    cols = ["schedule", "checkpoint@Dmax"] + [f"D={d}" for d in depths]
    cols += [f"slope (D>={lo})"]
    table = []
    for s in args.schedules:
        by = {r["depth"]: r for r in rows if r["schedule"] == s}
        sl = slopes[s]
        table.append(
            [s, by[depths[-1]]["checkpoint"]]
            + [C.fmt_bytes(by[d]["temp_bytes"]) for d in depths]
            + ["-" if sl is None else f"{sl:.2f}"]
        )
    console.print(describe)
    console.print(C.rich_table("Temp memory vs depth (CPU, compiled)", cols, table))
    ft = []
    for s in args.schedules:
        by = {r["depth"]: r for r in rows if r["schedule"] == s}
        base = {r["depth"]: r for r in rows if r["schedule"] == "None"}
        ft.append(
            [s, by[depths[-1]]["checkpoint"]]
            + [
                "-"
                if by[d]["flops"] is None or d not in base
                else f"{by[d]['flops'] / base[d]['flops']:.2f}x"
                for d in depths
            ]
        )
    console.print(C.rich_table("FLOPs vs None", cols[:-1], ft))
    ct = []
    for s in args.schedules:
        by = {r["depth"]: r for r in rows if r["schedule"] == s}
        ct.append(
            [s, by[depths[-1]]["checkpoint"]]
            + [f"{by[d]['compile_s']:.1f}" for d in depths]
        )
    console.print(C.rich_table("Compile time (s, median)", cols[:-1], ct))
    console.print(
        f"{len(rows)} compiles in {elapsed:.0f} s; results in {args.out}/{stem}.*"
    )
    return data


if __name__ == "__main__":
    main()

"""Compile time against depth: the scanned transformer at 4 and 64 layers.

Every zoo model applies its layers with one `lax.scan`, so compiling a 64-layer
model should take about as long as compiling a 4-layer one under `None` and every
policy (the target: at most 1.5x); `recursive()` and `binomial` trace O(log D)
nested loops by design, so theirs may grow up to log₂64 / log₂4 = 3x.

For each checkpoint, the training step (`jax.value_and_grad` of the loss of
`zoo.Transformer`, vmapped over the batch) is traced, lowered and compiled from
scratch (`jax.clear_caches()` first) at each depth, `--repeats` times,
interleaved (the loop of `depth_scaling.py`); the median is reported, with the
ratio of the deepest to the shallowest.

    python benchmarks/compile_time.py
    python benchmarks/compile_time.py --depths 4 16 64 --checkpoint None dots
    python benchmarks/compile_time.py --quick     # tests
"""

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks import _common, _models, _plots, depth_scaling


CHECKPOINTS = ("None", "dots", "nothing", "every(2)", "recursive()", "binomial(3)")
LIMIT = 1.5  # the target, for None and every policy


def _parser() -> argparse.ArgumentParser:
    p = depth_scaling.parser(__doc__, [4, 64], "transformer layers")
    _common.int_flag(p, "--d-model", 128, metavar=None)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = _common.parse_args(_parser(), argv, "compile_time")
    specs = args.checkpoint or CHECKPOINTS
    if args.quick:
        args.depths, specs, args.repeats, args.d_model = [2, 8], ["None"], 1, 32
    seq, batch = (16, 2) if args.quick else (128, 4)

    def preset(n: int) -> _models.TransformerPreset:
        heads = max(1, args.d_model // 32)
        return _models.TransformerPreset(
            batch=batch, seq=seq, d_model=args.d_model, heads=heads, layers=n
        )

    def measure(point: tuple[str, int], first: bool) -> float:
        p = preset(point[1])
        checkpoint = _common.parse_checkpoint(point[0], p.depth)
        fn, params = _models.ours(p, p.build(abstract=True), checkpoint)
        return depth_scaling.compile_seconds(fn, params, p.inputs(abstract=True))

    console, t0 = _common.Console(), time.perf_counter()
    points = {(s, n): f"{s}, {n} layers" for s in specs for n in args.depths}
    times = depth_scaling.interleaved(console, args.repeats, points, measure)
    rows = [
        {
            "checkpoint": s,
            "layers": n,
            "compile_s": statistics.median(ts),
            "times_s": ts,
        }
        for (s, n), ts in times.items()
    ]
    lo, hi = min(args.depths), max(args.depths)
    med = {(r["checkpoint"], r["layers"]): r["compile_s"] for r in rows}
    ratios = {s: med[(s, hi)] / med[(s, lo)] for s in specs}
    describe = preset(hi).describe().replace(f"{hi} layers", "N layers")
    data = {
        "meta": _common.meta(args, seconds=time.perf_counter() - t0, describe=describe),
        "rows": rows,
        "ratio_deepest_to_shallowest": ratios,
        "targets": [target(ratios, lo, hi)],
    }
    path = _common.write(args, "compile_time" + "_quick" * args.quick, data, plot)
    console.print(describe)
    console.table(
        f"Compile time, s (median) [{_common.where_compiled(data)}]",
        ["checkpoint", *(f"{n} layers" for n in args.depths), f"{hi} / {lo}"],
        [
            [s, *(f"{med[(s, n)]:.2f}" for n in args.depths), _common.fmt_ratio(x)]
            for s, x in ratios.items()
        ],
        left=1,
    )
    _common.show_targets(console, data["targets"])
    console.print(f"results in {path}")
    return data


def target(ratios: dict[str, float], lo: int, hi: int) -> dict:
    """The verdict: compile time at `hi` layers over `lo` layers, at most `LIMIT`
    for `None` and every policy (schedules may grow by design)."""
    policies = [
        x
        for s, x in ratios.items()
        if isinstance(_common.parse_checkpoint(s, hi), str | None)
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
    """Per checkpoint: compile time at each depth, side by side (median; bars:
    the fastest and slowest of its compiles)."""
    pyplot = _common.plt()
    rows = data["rows"]
    specs = list(dict.fromkeys(r["checkpoint"] for r in rows))
    depths = sorted({r["layers"] for r in rows})
    fig, ax = pyplot.subplots(figsize=(7.5, 4.5))
    width = 0.8 / len(depths)
    for j, d in enumerate(depths):
        pts = [(specs.index(r["checkpoint"]), r) for r in rows if r["layers"] == d]
        bars = [_plots.spread(r["times_s"], r["compile_s"], 1.0) for _, r in pts]
        ax.bar(
            [i + j * width for i, _ in pts],
            [r["compile_s"] for _, r in pts],
            width,
            yerr=np.transpose(bars),
            capsize=3,
            label=f"{d} layers",
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(specs))], specs)
    ax.set_ylabel("trace + lower + compile (s)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=9)
    meta = data["meta"]
    n = max(len(r["times_s"]) for r in rows)
    _plots.suptitle(
        fig,
        f"Compile time of a training step against depth, per checkpoint (median; "
        f"bars: {_plots.spread_name(n, 'compiles')})\n{meta['describe']}; "
        f"{meta['device']}, {meta['cpu_count']} cores, jax "
        f"{meta['versions']['jax']}, {meta['date']}",
        fontsize=9,
    )
    _common.save_figure(fig, path)


if __name__ == "__main__":
    main()

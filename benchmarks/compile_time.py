"""Compile time against depth: the scanned transformer at 4 and 64 layers.

Every zoo model applies its layers with one `lax.scan`, so compiling a 64-layer
model should take about as long as compiling a 4-layer one under `None` and every
policy (the target: at most 1.5x); `recursive()` and `binomial` trace O(log D)
nested loops by design, so theirs may grow up to log₂64 / log₂4 = 3x.

For each checkpoint, the training step (`jax.value_and_grad` of the loss of
`zoo.Transformer`, vmapped over the batch) is traced, lowered and compiled from
scratch (`jax.clear_caches()` first) at each depth, `--repeats` times,
interleaved; the median is reported, with the ratio of the deepest to the
shallowest.

    python benchmarks/compile_time.py
    python benchmarks/compile_time.py --layers 4 16 64 --checkpoints None dots
    python benchmarks/compile_time.py --quick     # tests
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
import jax  # noqa: E402


CHECKPOINTS = ("None", "dots", "nothing", "every(2)", "recursive()", "binomial(3)")


def compile_seconds(preset, spec: str) -> float:
    jax.clear_caches()
    model = M.build(preset, abstract=True)
    fn, params = M.ours(preset, model, C.parse_checkpoint(spec, preset.depth))
    t0 = time.perf_counter()
    jax.jit(fn).lower(params, M.batch(preset, abstract=True)).compile()
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 64])
    p.add_argument("--checkpoints", nargs="+", default=list(CHECKPOINTS))
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny (tests)")
    p.add_argument("--out", type=Path, default=C.RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.checkpoints, args.repeats = [2, 8], ["None"], 1
        args.d_model, args.seq, args.batch = 32, 16, 2
    console = C.console()
    from rich.progress import Progress

    def preset(n):
        return M.TransformerPreset(
            256, args.seq, args.d_model, max(1, args.d_model // 32), n, args.batch
        )

    times: dict[tuple[str, int], list[float]] = {}
    t0 = time.perf_counter()
    with Progress(console=console) as prog:
        total = args.repeats * len(args.checkpoints) * len(args.layers)
        task = prog.add_task("", total=total)
        for r in range(args.repeats):
            for spec in args.checkpoints:
                for n in args.layers:
                    prog.update(task, description=f"round {r + 1}: {spec}, {n} layers")
                    s = compile_seconds(preset(n), spec)
                    times.setdefault((spec, n), []).append(s)
                    prog.advance(task)
    elapsed = time.perf_counter() - t0

    lo, hi = min(args.layers), max(args.layers)
    rows = []
    for spec in args.checkpoints:
        for n in args.layers:
            ts = times[(spec, n)]
            rows.append(
                {
                    "checkpoint": spec,
                    "layers": n,
                    "median_s": statistics.median(ts),
                    "times_s": ts,
                }
            )
    med = {(r["checkpoint"], r["layers"]): r["median_s"] for r in rows}
    ratios = {s: med[(s, hi)] / med[(s, lo)] for s in args.checkpoints}
    policies = {s: x for s, x in ratios.items() if "(" not in s}
    schedules = {s: x for s, x in ratios.items() if "(" in s}
    describe = preset(hi).describe().replace(f"{hi} layers", "N layers")
    stem = "compile_time" + ("_quick" if args.quick else "")
    data = {
        "meta": C.meta(argv, seconds=elapsed, describe=describe),
        "rows": rows,
        "ratio_deepest_to_shallowest": ratios,
        "target": {
            "name": f"compile time at {hi} layers <= 1.5x at {lo} layers "
            "(None and every policy)",
            "met": all(x <= 1.5 for x in policies.values()),
            "policies": policies,
            # recursive / binomial trace O(log D) loops by design: log2 ratio.
            "schedules": schedules,
            "log2_depth_ratio": math.log2(hi) / math.log2(lo) if lo > 1 else None,
        },
    }
    C.write_json(args.out / f"{stem}.json", data)
    C.write_csv(args.out / f"{stem}.csv", rows)

    pyplot = C.plt()
    fig, ax = pyplot.subplots(figsize=(6.5, 4.5))
    for spec in args.checkpoints:
        ax.plot(
            args.layers, [med[(spec, n)] for n in args.layers], marker="o", label=spec
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("layers")
    ax.set_ylabel("trace + lower + compile (s, median)")
    ax.set_ylim(bottom=0)
    ax.set_title(describe, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / f"{stem}.png", dpi=110)
    pyplot.close(fig)

    cols = ["checkpoint"] + [f"{n} layers (s)" for n in args.layers]
    cols += [f"{hi} / {lo}"]
    table = [
        [s] + [f"{med[(s, n)]:.2f}" for n in args.layers] + [f"{ratios[s]:.2f}x"]
        for s in args.checkpoints
    ]
    console.print(describe)
    console.print(C.rich_table("Compile time (CPU, median)", cols, table))
    console.print(
        f"target (None and policies <= 1.5x): "
        f"{'met' if data['target']['met'] else 'NOT met'}; "
        f"{elapsed:.0f} s; results in {args.out}/{stem}.*"
    )
    return data


if __name__ == "__main__":
    main()

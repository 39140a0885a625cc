"""The sweep: each preset's training step compiled under every checkpoint,
beside the same model written by hand (`lax.scan` + `jax.checkpoint`), in Flax
linen and with `equinox.internal.scan`, on the same weights: memory, FLOPs,
step time, and on an accelerator peak memory, throughput, MFU and HFU; the
project's targets judged on them (benchmarks/README.md says how).

    python benchmarks/run.py                  # the sweep, on this machine's device
    python benchmarks/run.py --quick          # tiny, end to end (tests)
    python benchmarks/run.py --preset v5e-fits v5e-tight    # real runs on a v5e host
    python benchmarks/run.py --target v5e     # per-chip v5e memory, compiled, not run
"""

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from benchmarks import _common, _measure, _models, _plots, _targets


def _parser() -> argparse.ArgumentParser:
    p = _common.parser(__doc__, presets=list(_models.PRESETS), runs=True)
    p.add_argument("--no-peers", action="store_true", help="only ours (default: off)")
    p.add_argument(
        "--name", metavar="STEM", help="results file stem (default: sweep-<device>)"
    )
    return p


def presets_of(args: argparse.Namespace) -> dict[str, _models.Preset]:
    """`--preset`, else the default list for `--quick`, `--target`, the device."""
    names = args.preset or (
        _models.QUICK
        if args.quick
        else _models.V5E
        if args.target
        else _models.ACCELERATOR
        if args.platform != "cpu"
        else _models.DEFAULT
    )
    return {n: _models.PRESETS[n] for n in names}


def _depth_problem(args: argparse.Namespace) -> str | None:
    depths = {f"--preset {n}": p.depth for n, p in presets_of(args).items()}
    return _common.depth_problem(args.checkpoint, depths)


def measure(args: argparse.Namespace, variants: list, console: _common.Console) -> list:
    """One row per variant: compiled for `--target`, or each in its own process
    (`--isolate`), or timed round-robin here."""
    with console.progress(len(variants) + (0 if args.target else args.repeats)) as step:
        if args.target:
            rows = []
            for v in variants:
                step(f"compile {v.group} {v.impl} {v.checkpoint}")
                rows.append(_measure.compile_aot(v, args.target))
            return rows
        if args.deferred:
            rows = _measure.measure_isolated(variants, argv=args.argv, step=step)
            _common.set_main(rows[0].get("process_index", 0) == 0)
            return rows
        return _measure.measure_here(
            variants, repeats=args.repeats, limit=args.memory_limit, step=step
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _common.parse_args(
        _parser(), argv, "run", defer=_common.isolate, check=_depth_problem
    )
    console = _common.Console()
    base = presets_of(args)
    # Ours under each checkpoint, then the peers, of every preset.
    devices = 1 if args.deferred else _measure.mesh_for(args.target).size
    presets = {n: p.on(devices) for n, p in base.items()}
    accelerator = bool(args.target) or args.platform != "cpu"
    variants = []
    for name, p in presets.items():
        variants += _measure.variants(
            name,
            p,
            args.checkpoint or p.checkpoints(quick=args.quick, accelerator=accelerator),
            target=args.target,
            peers=not args.no_peers,
            quick=args.quick,
        )
    if args.worker:
        return _measure.worker(args, variants)
    t0 = time.perf_counter()
    console.print(
        f"run.py: {len(variants)} variants of {len(presets)} presets, each "
        "compiled (and, but for --target, run) in turn; the default sweep takes "
        "about 4 minutes on a 2-core CPU, --quick a minute."
    )
    rows = measure(args, variants, console)
    if args.deferred:  # the measuring processes know how many devices there are
        devices = rows[0].get("device_count") or 1
        presets = {n: p.on(devices) for n, p in base.items()}
    _measure.add_figures(rows, presets)
    data = {
        "meta": _common.meta(args, rows[0], seconds=time.perf_counter() - t0),
        "presets": {
            n: {"type": type(p).__name__, "describe": p.describe()}
            | dataclasses.asdict(p)
            for n, p in presets.items()
        },
        "rows": rows,
        "peers": _targets.peer_pairs(rows),
        "targets": _targets.evaluate(rows, presets),
    }
    tag = (args.target or args.platform).replace(":", "_")
    path = _common.write(
        args, args.name or f"sweep-{tag}" + "-quick" * args.quick, data, plot
    )
    show(console, data, _common.where(args, data))
    console.print(LEGEND)
    done = f"{len(rows)} variants in {data['meta']['seconds']:.0f} s"
    if path is not None:
        done += (
            f"; results in {path} and beside it {path.with_suffix('.csv').name} "
            f"(every row) and {path.with_suffix('.png').name} (the plot)"
        )
    console.print(done)
    return data


# --------------------------------------------------------------------------------------
# Tables and the plot.

SWEEP = ("impl", "checkpoint", "temp", "/None", "FLOPs", "/None", "ms", "/None")
SWEEP += ("peak", "rate", "MFU", "HFU", "fits")
"""The sweep table's columns, one table per preset (`LEGEND` says what each is);
columns `n/a` in every row (the device's on a CPU) are not printed."""

LEGEND = (
    "Columns: temp = compiled temporary memory of the step (per chip for a "
    "target); /None = that figure divided by checkpoint=None's in the same "
    "preset; FLOPs = eqx_remat.count_flops, recomputation included; ms = median "
    "step time; peak = measured peak device memory (AOT: the compiler's figure); "
    "rate = tokens (or examples) per second; MFU / HFU = model / hardware FLOP "
    "utilisation; fits = whether XLA compiled it within one device's memory. "
    "Targets: met / NOT met against the threshold named; a note says why a "
    "target is expected to miss here (noisy CPU timings, a strict form beside "
    "its relaxed one)."
)


def _rate(r: dict) -> str:
    tput = r.get("tokens_per_s") or r.get("examples_per_s")
    if tput is None:
        return "n/a"
    unit = "tok/s" if "tokens_per_s" in r else "ex/s"
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k"), (1, "")):
        if tput >= scale:
            return f"{tput / scale:.3g}{prefix} {unit}"
    return f"{tput:.2g} {unit}"


def sweep_rows(rows: list[dict]) -> list[list[str]]:
    """The cells of `SWEEP` for `rows` (all of one preset)."""
    out = []
    for r in rows:
        step, aot = r.get("step_s"), r.get("aot_total_bytes")
        peak = _common.fmt_bytes(r.get("peak_bytes"))
        out.append(
            [
                r["impl"],
                r["checkpoint"],
                _common.fmt_bytes(r.get("temp_bytes")),
                _common.fmt_ratio(r.get("temp_ratio")),
                _common.fmt_flops(r.get("flops")),
                _common.fmt_ratio(r.get("flops_ratio")),
                "n/a" if step is None else f"{1e3 * step:.1f}",
                _common.fmt_ratio(r.get("time_ratio")),
                peak + (f" (AOT {_common.fmt_bytes(aot)})" if aot else ""),
                _rate(r),
                _common.fmt_pct(r.get("mfu")),
                _common.fmt_pct(r.get("hfu")),
                "yes" if r["fits"] else f"no: {r.get('error', '')[:60]}",
            ]
        )
    return out


def show(console: _common.Console, data: dict, where: str) -> None:
    """The sweep's tables: one per preset, the peers, the targets."""
    for n, p in data["presets"].items():
        rows = [r for r in data["rows"] if r["group"] == n]
        console.table(
            f"{n} [{where}]: {p['describe']}", SWEEP, sweep_rows(rows), left=2
        )
    if data["peers"]:
        console.table(
            "Against peers (same weights)",
            ("preset", "ours", "peer", "temp/peer", "time/peer", "loss Δ"),
            [
                (
                    p["group"],
                    p["ours"],
                    p["peer"],
                    _common.fmt_ratio(p["temp_ratio"]),
                    _common.fmt_ratio(p["time_ratio"]),
                    f"{p['loss_abs_diff']:.1e}" if "loss_abs_diff" in p else "n/a",
                )
                for p in data["peers"]
            ],
        )
    _common.show_targets(console, data["targets"])


def _what(data: dict, cost: str) -> str:
    """The figure's title: what was measured, where."""
    meta = data["meta"]
    when = f"jax {meta['versions']['jax']}, {meta['date']}"
    if meta.get("target"):
        where = f"compiled for TPU {meta['target']} on a CPU, not run; {when}"
        memory = "per-chip compiled temp memory"
    else:
        cores = f", {meta['cpu_count']} cores" if meta["backend"] == "cpu" else ""
        where, memory = f"{meta['device']}{cores}, {when}", "compiled temp memory"
    if cost == "time_ratio":
        n = max(len(r.get("times_s") or ()) for r in data["rows"])
        against = f"median step time vs None (bars: {_plots.spread_name(n)})"
    else:
        against = "FLOPs per step vs None (recomputation included)"
    return f"Training step: {memory} against {against}\n{where}"


def _plot_preset(ax: Any, data: dict, group: str, cost: str) -> list:
    """One preset's panel: a point per implementation and checkpoint. Returns
    `[labelled, others]` for `_plots.label_points`: eqx_remat's points and a
    peer's few (the chains'), named; a peer's many, in the legend only."""
    rows = [
        r
        for r in data["rows"]
        if r["group"] == group and r.get(cost) is not None and r.get("temp_bytes")
    ]
    unit, size = _plots.byte_unit([r["temp_bytes"] for r in rows])
    labelled, others = [], []
    for impl in dict.fromkeys(r["impl"] for r in rows):
        pts = [r for r in rows if r["impl"] == impl]
        xy = [(r[cost], r["temp_bytes"] / size) for r in pts]
        xerr = None
        if cost == "time_ratio" and all(r.get("times_s") for r in pts):
            bars = [
                _plots.spread(r["times_s"], r[cost], r["step_s"] / r[cost]) for r in pts
            ]
            xerr = [[lo for lo, _ in bars], [hi for _, hi in bars]]
        ax.errorbar(
            *zip(*xy), xerr=xerr, fmt="o", ms=5, capsize=2, elinewidth=0.8,
            alpha=0.85, label=impl,
        )  # fmt: skip
        names = [r["checkpoint"] for r in pts]
        if impl == "eqx_remat":
            labelled += [(x, y, n) for (x, y), n in zip(xy, names)]
        elif len(pts) <= 3:  # a peer's few points (the chains'): named
            labelled += [(x, y, f"{impl} ({n})") for (x, y), n in zip(xy, names)]
        else:  # a peer beside every policy: its colour, in the legend
            others += xy
    _plots.panel_title(ax, group, data["presets"][group]["describe"])
    ax.set(
        xlabel="step time vs None" if cost == "time_ratio" else "FLOPs vs None",
        ylabel=f"temp memory ({unit})",
    )
    ys = [p[1] for p in labelled + others]
    _plots.scale_for(ax, "y", ys)
    _plots.zero_based_if_narrow(ax, "y", ys)
    ax.grid(alpha=0.3)
    if len({r["impl"] for r in rows}) > 1:
        ax.legend(fontsize=8.5)
    return [labelled, others]


def plot(data: dict, path: Path) -> None:
    """Per preset: compiled temp memory against step time (or FLOPs, where
    nothing was timed) relative to `None`, one colour per implementation."""
    groups = list(data["presets"])
    timed = any(r.get("time_ratio") is not None for r in data["rows"])
    cost = "time_ratio" if timed else "flops_ratio"
    ncols = min(2, len(groups))
    nrows = -(-len(groups) // ncols)
    fig, axes = _common.plt().subplots(
        nrows, ncols, figsize=(6.2 * ncols, 4.4 * nrows + 0.6), squeeze=False
    )
    panels = [_plot_preset(ax, data, g, cost) for ax, g in zip(axes.flat, groups)]
    for ax in axes.flat[len(groups) :]:
        ax.remove()
    _plots.suptitle(fig, _what(data, cost))
    fig.tight_layout()
    for ax, (labelled, others) in zip(axes.flat, panels):
        _plots.label_points(ax, labelled, others)
    _common.save_figure(fig, path)


if __name__ == "__main__":
    main()

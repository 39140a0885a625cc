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

from benchmarks import (
    _cli,
    _console,
    _ending,
    _format,
    _measure,
    _models,
    _plots,
    _results,
    _table,
    _targets,
)


def _parser() -> argparse.ArgumentParser:
    p = _cli.parser(__doc__, presets=list(_models.PRESETS), runs=True)
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
    return _cli.depth_problem(args.checkpoint, depths)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _cli.parse_args(
        _parser(), argv, "run", defer=_cli.isolate, check=_depth_problem
    )
    console = _console.Console()
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
        f"run.py: {_measure.plan_of_work(args, variants, len(presets))}; the "
        "default sweep takes about 4 minutes on a 2-core CPU, --quick a minute."
    )
    rows = _measure.measure_all(args, variants, console)
    if args.deferred:  # the measuring processes know how many devices there are
        devices = rows[0].get("device_count") or 1
        presets = {n: p.on(devices) for n, p in base.items()}
    _measure.add_figures(rows, presets)
    data = {
        "meta": _results.meta(args, rows[0], seconds=time.perf_counter() - t0),
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
    return _ending.finish(
        args,
        console,
        data,
        stem=args.name or _results.stem(args, f"sweep-{tag}"),
        plot=plot,
        show=show,
    )


# --------------------------------------------------------------------------------------
# Tables and the plot.


@dataclasses.dataclass(frozen=True)
class Row:
    """One variant: a preset's training step under one checkpoint, ours or a
    peer's (the fields the tables read; the results file has more)."""

    group: str  # the preset
    impl: str  # eqx_remat, or the peer
    checkpoint: str
    fits: bool
    temp_bytes: int | None = None
    temp_ratio: float | None = None
    flops: int | None = None
    flops_ratio: float | None = None
    step_s: float | None = None
    time_ratio: float | None = None
    peak_bytes: int | None = None
    aot_total_bytes: int | None = None
    tokens_per_s: float | None = None
    examples_per_s: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    error: str | None = None


def _rate(r: Row) -> str:
    tput = r.tokens_per_s or r.examples_per_s
    if tput is None:
        return "n/a"
    unit = "tok/s" if r.tokens_per_s else "ex/s"
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k"), (1, "")):
        if tput >= scale:
            return f"{tput / scale:.3g}{prefix} {unit}"
    return f"{tput:.2g} {unit}"


def _peak(r: Row) -> str:
    aot = f" (AOT {_format.fmt_bytes(r.aot_total_bytes)})" if r.aot_total_bytes else ""
    return _format.fmt_bytes(r.peak_bytes) + aot


C = _table.Column
COLUMNS: list[_table.Column[Row]] = [
    C("preset", lambda r: r.group),
    C("impl", lambda r: r.impl),
    C("checkpoint", lambda r: r.checkpoint, code=True),
    C(
        "temp",
        lambda r: _format.fmt_bytes(r.temp_bytes),
        "compiled temporary memory of the step (per chip for a target)",
    ),
    C(
        "temp/None",
        lambda r: _format.fmt_ratio(r.temp_ratio),
        "temp divided by checkpoint=None's in the same preset",
    ),
    C(
        "FLOPs",
        lambda r: _format.fmt_flops(r.flops),
        "eqx_remat.count_flops, recomputation included",
    ),
    C("FLOPs/None", lambda r: _format.fmt_ratio(r.flops_ratio), "FLOPs / None's"),
    C(
        "ms",
        lambda r: "n/a" if r.step_s is None else f"{1e3 * r.step_s:.1f}",
        "median step time",
    ),
    C("time/None", lambda r: _format.fmt_ratio(r.time_ratio), "ms / None's"),
    C(
        "peak",
        _peak,
        "measured peak device memory (AOT: the compiler's figure for the same "
        "topology)",
    ),
    C("rate", _rate, "tokens (or examples) per second"),
    C("MFU", lambda r: _format.fmt_pct(r.mfu), "model FLOP utilisation"),
    C(
        "HFU",
        lambda r: _format.fmt_pct(r.hfu),
        "hardware FLOP utilisation (recomputation counted)",
    ),
    C(
        "fits",
        lambda r: "yes" if r.fits else f"no: {(r.error or '')[:60]}",
        "whether XLA compiled it within one device's memory",
    ),
]
"""The sweep's columns: the console prints one table per preset (without the
preset column), report.py one table; a column `n/a` in every row (the device's,
on a CPU) is left out, and so is its line of the legend."""


def _losses(p: dict) -> str:
    if "losses_equal" not in p:
        return "n/a"
    return f"{'yes' if p['losses_equal'] else 'NO'} (Δ {p['loss_abs_diff']:.0e})"


PEER_COLUMNS: list[_table.Column[dict]] = [
    C("preset", lambda p: p["group"]),
    C("ours", lambda p: p["ours"], code=True),
    C("peer", lambda p: p["peer"]),
    C("temp ours/peer", lambda p: _format.fmt_ratio(p["temp_ratio"])),
    C("time ours/peer", lambda p: _format.fmt_ratio(p["time_ratio"])),
    C("losses equal", _losses),
]
"""The peers' table (`_targets.peer_pairs`: ours beside a peer on the same
weights), on the console and in report.py."""

TARGETS_NOTE = (
    "Targets: met / NOT met against the threshold named; a note says why a "
    "target is expected to miss here."
)


def show(console: _console.Console, data: dict, where: str) -> None:
    """The sweep's tables: one per preset, the peers, and the legend of the
    columns shown."""
    rows = _table.read_all(Row, data["rows"])
    shown: dict[str, _table.Column] = {}
    for n, p in data["presets"].items():
        mine = [r for r in rows if r.group == n]
        title = f"{n} [{where}]: {p['describe']}"
        for c in _table.show(console, title, COLUMNS[1:], mine):
            shown[c.name] = c
    if data["peers"]:
        peers = "Against peers (same weights)"
        _table.show(console, peers, PEER_COLUMNS, data["peers"], left=3)
    console.print(_table.legend(list(shown.values())) + " " + TARGETS_NOTE)


def report(data: dict) -> str:
    """report.py's section: the presets, one table of every row, the peers."""
    rows = _table.read_all(Row, data["rows"])
    parts = [_table.presets_markdown(data), _table.markdown(COLUMNS, rows)]
    if data.get("peers"):
        parts.append(_table.markdown(PEER_COLUMNS, data["peers"]))
    return "\n\n".join([*parts, _table.targets_markdown(data)])


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
    if _plots.is_narrow(ys):  # from zero, the points would be one band
        spread = 100 * (1 - min(ys) / max(ys))
        ax.set_ylabel(f"temp memory ({unit})\nnot from 0: all within {spread:.0f}%")
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
    fig, axes = _plots.plt().subplots(
        nrows, ncols, figsize=(6.2 * ncols, 4.4 * nrows + 0.6), squeeze=False
    )
    panels = [_plot_preset(ax, data, g, cost) for ax, g in zip(axes.flat, groups)]
    for ax in axes.flat[len(groups) :]:
        ax.remove()
    _plots.suptitle(fig, _what(data, cost))
    fig.tight_layout()
    for ax, (labelled, others) in zip(axes.flat, panels):
        _plots.label_points(ax, labelled, others)
    _plots.save_figure(fig, path)


if __name__ == "__main__":
    main()

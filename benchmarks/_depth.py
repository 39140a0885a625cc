"""Measuring against depth, shared by `depth_scaling.py` and `compile_time.py`:
their flags (`--depths`), a compile timed from scratch, the rounds interleaved
over every (checkpoint, depth) point, and the plot against depth."""

import argparse
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _cli, _console, _format, _plots, _table, _timing


def parser(doc: str, depths: list[int], what: str) -> argparse.ArgumentParser:
    """The flags of both compile-time scripts: `--depths` (of `what`)."""
    p = _cli.parser(doc, repeats=3, target=False)
    _cli.int_flag(p, "--depths", depths, f"the depths to measure: {what}", nargs="+")
    return p


def compile_seconds(fn: Callable, *args) -> float:
    """Trace, lower and compile `fn` from scratch (caches cleared first):
    `_timing.compile_step`'s seconds."""
    jax.clear_caches()
    return _timing.compile_step(fn, *args).compile_s


def sweep(
    console: _console.Console,
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


def depth_problem(args: argparse.Namespace) -> str | None:
    """`--checkpoint` at each of `--depths`."""
    depths = {f"--depths {n}": n for n in args.depths}
    return _cli.depth_problem(args.checkpoint, depths)


class Line(NamedTuple):
    """One line of a table against depth: a checkpoint, its row at each depth
    (`Row`s of the script: any with the fields the cells read)."""

    spec: str
    at: dict[int, Any]


def lines(rows: Sequence[Any], spec: str, depth: str) -> list[Line]:
    """`rows` (typed rows, each at one checkpoint `spec` and one `depth`, named
    by those fields) as one `Line` per checkpoint, in their first order."""
    out: dict[str, dict[int, Any]] = {}
    for r in rows:
        out.setdefault(getattr(r, spec), {})[getattr(r, depth)] = r
    return [Line(s, at) for s, at in out.items()]


def columns(
    depths: Sequence[int],
    cell: Callable[[Any], str],
    label: str = "D={}",
    extra: Sequence[_table.Column[Line]] = (),
) -> list[_table.Column[Line]]:
    """A table against depth's column spec: the checkpoint, `cell(row)` at each
    of `depths` (headed `label.format(depth)`), then `extra`."""
    return [
        _table.Column("checkpoint", lambda line: line.spec, code=True),
        *(
            _table.Column(label.format(d), lambda line, d=d: cell(line.at[d]))
            for d in depths
        ),
        *extra,
    ]


def joined(depths: Sequence[int]) -> bool:
    """Whether a curve through `depths` joins only neighbours of the sweep
    (each depth at most twice the one before): a line across a wider gap
    would draw depths never measured."""
    ds = sorted(depths)
    return all(b <= 2 * a for a, b in zip(ds, ds[1:]))


def plot(data: dict, path: Path, what: str = "") -> None:
    """Against depth, per checkpoint (`spec`): compiled temp memory (its axis log
    where the range calls for it) and FLOPs relative to `None`, where the rows
    have them, and compile time (bars: the spread of `compile_times_s`). `what`:
    the title (default: this script's)."""
    from matplotlib.ticker import NullLocator

    rows = data["rows"]
    by_spec: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["depth"]):
        by_spec.setdefault(r["spec"], []).append(r)
    base = {r["depth"]: r.get("flops") for r in by_spec.get("None", [])}
    panels = {  # y label: the value of a row (none: not drawn)
        "compiled temp memory (MiB)": lambda r: r["temp_bytes"] / _format.MiB,
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
    fig, axes = _plots.plt().subplots(
        1, len(panels), figsize=(max(7.5, 5 * len(panels)), 5), squeeze=False
    )
    depths = sorted({r["depth"] for r in rows})
    # Sweeps far apart: points only, each checkpoint's a little aside (on the
    # log axis) so that none hides another.
    dodge = 0 if joined(depths) else 0.06
    for ax, (label, value) in zip(axes[0], panels.items()):
        for j, (spec, rs) in enumerate(by_spec.items()):
            rs = [r for r in rs if value(r)]
            aside = 2 ** (dodge * (j - (len(by_spec) - 1) / 2))
            notes = [f"{w} as {h[spec]}" for w, h in hidden.items() if spec in h]
            bars = [_plots.spread(r["compile_times_s"], r["compile_s"], 1) for r in rs]
            ax.errorbar(
                [r["depth"] * aside for r in rs],
                [value(r) for r in rs],
                yerr=np.transpose(bars) if label.startswith("trace") else None,
                marker="o",
                linestyle="none" if dodge else "-",
                capsize=2,
                elinewidth=0.8,
                label=spec + (f" ({', '.join(notes)}: hidden)" if notes else ""),
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(depths, [f"{d:g}" for d in depths], minor=False)
        ax.xaxis.set_minor_locator(NullLocator())
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
    _plots.save_figure(fig, path, rect=(0, 0.07, 1, 1))

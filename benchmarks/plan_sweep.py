"""The planner's frontier: `eqx_remat.plan` at `--budgets` budgets, from its
lightest option's compiled memory to `None`'s, each pick beside every uniform
candidate; on the device, every frontier point, pick and uniform checkpoint is
then timed afresh in `--repeats` interleaved rounds (`--no-clock`: not). A
preset of several stacks (`encoder-decoder`) is planned the same way, and each
pick is timed beside every combination of one uniform candidate per stack
(that experiment: `_plan_stacks.py`; what both share: `_planner.py`). How the
budgets are chosen and what the targets ask: benchmarks/README.md.

    python benchmarks/plan_sweep.py                                 # transformer-s, CPU
    python benchmarks/plan_sweep.py --preset transformer-s transformer-w  # + 8x FLOPs
    python benchmarks/plan_sweep.py --preset encoder-decoder        # two stacks
    python benchmarks/plan_sweep.py --target v5e:2x4 --preset seed-llama  # v5e AOT
    python benchmarks/plan_sweep.py --quick                         # tiny (tests)
"""

import argparse
import contextlib
import dataclasses
import textwrap
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

import eqx_remat as er
import zoo
from benchmarks import (
    _cli,
    _console,
    _ending,
    _format,
    _measure,
    _models,
    _plan_stacks,
    _planner,
    _plots,
    _results,
    _table,
    _targets,
    _timing,
)
from benchmarks._results import of_kind


def _parser() -> argparse.ArgumentParser:
    p = _cli.parser(__doc__, presets=list(_models.PRESETS), repeats=25)
    p.add_argument(
        "--no-clock",
        dest="clock",
        action="store_false",
        help="on the device: do not time the frontier, picks and uniform "
        "checkpoints afresh (default: time them)",
    )
    _cli.int_flag(p, "--budgets", 10, "how many budgets, evenly spaced")
    return p


def _budgets(args, fn, model, batch, top: er.PlanResult, cap: int) -> list[int]:
    """`--budgets` evenly spaced from the least compiled memory on `top`'s
    frontier to `None`'s (on the device 1.1x that), or `cap` where `None`
    needs more; on the device also half-way between `top`'s uniform points."""
    try:
        none = er.plan(
            fn, model, batch, budget_bytes=cap, target=args.target, candidates=[None]
        ).entry.memory_bytes
        high = min(cap, int(none * (1.0 if args.target else 1.1)))
    except ValueError:  # None does not fit one device (XLA refuses it)
        high = cap
    low = min(p.compiled_bytes for p in top.frontier if p.compiled_bytes)
    if args.budgets == 1 or high <= low:
        budgets = [high]
    else:
        budgets = [int(round(b)) for b in np.linspace(low, high, args.budgets)]
    if args.target:
        return budgets
    uniform = sorted(
        p.compiled_bytes
        for p in top.frontier
        if p.compiled_bytes and not isinstance(p.checkpoint, er.ranges)
    )
    # Points under 1% apart are one: a mix between them has less room than the
    # planner's memory predictions may miss.
    pairs = zip(uniform, uniform[1:])
    return sorted(set(budgets) | {(lo + hi) // 2 for lo, hi in pairs if hi > 1.01 * lo})


def sweep_preset(args, name: str, preset: _models.Preset, console) -> list[dict]:
    """The rows of one preset: "planning", "uniform", "pick", "frontier" and,
    timed on the device, "timed" and "rounds" (several stacks:
    `_plan_stacks.sweep`)."""
    if len(preset.stack_depths()) > 1:
        return _plan_stacks.sweep(args, name, preset, console)
    specs = args.checkpoint or preset.checkpoints(
        quick=args.quick, accelerator=bool(args.target)
    )
    cands = [er.parse_checkpoint(s, preset.depth) for s in specs]
    mesh = _measure.mesh_for(args.target) if args.target else None
    model, batch = preset.build(abstract=True), preset.inputs(abstract=True)
    if mesh is not None:
        model = zoo.shard(model, mesh, fsdp=preset.fsdp)
        batch = _measure.place_batch(batch, mesh)
    fn = _planner.step_fn(preset, mesh)
    cap = _measure.V5E_HBM if args.target else 2**50
    # The flash kernel finds the mesh to shard_map over in the context.
    flash = mesh is not None and getattr(preset, "attention", None) == "flash"
    with jax.set_mesh(mesh) if flash else contextlib.nullcontext():
        planning, budgets, results, plans = _planner.plan_budgets(
            args,
            name,
            fn,
            model,
            batch,
            cap,
            console,
            choose=lambda top: _budgets(args, fn, model, batch, top, cap),
        )
        uniform = er.plan(
            fn, model, batch, budget_bytes=cap, target=args.target, candidates=cands
        ).table
    rows = [planning, *(_uniform_row(name, e, cap) for e in uniform)]
    rows += [_pick_row(name, b, r, uniform) for b, r in zip(budgets, results)]
    frontier = _frontier(plans)
    rows += [{"group": name, "kind": "frontier", **p} for p in frontier]
    if not args.clock or args.target:
        return rows
    timed = clock_rows(args, name, fn, model, batch, plans, uniform, console)
    on = {p["checkpoint"] for p in frontier}
    for r in timed:
        r["on_frontier"] = r["checkpoint"] in on
    by = {r["checkpoint"]: r for r in timed}
    for r in of_kind(rows, "pick"):
        if r["checkpoint"] in by:
            _clock_pick(r, by[r["checkpoint"]], timed)
    return rows + [*timed, few_rounds(name, timed)]


def clock_rows(args, name, fn, model, batch, plans, uniform, console) -> list[dict]:
    """Every frontier point, pick and uniform checkpoint of `plans` and
    `uniform`, compiled and timed afresh, round-robin: a "timed" row each."""
    predicted: dict[Any, er.FrontierPoint | er.PlanEntry] = {}
    for r in plans:
        predicted.update((p.checkpoint, p) for p in r.frontier)
        predicted.setdefault(r.checkpoint, r.entry)
    for e in uniform:
        predicted.setdefault(e.checkpoint, e)
    console.print(
        f"[bold]{name}[/]: timing {len(predicted)} checkpoints afresh, "
        f"{args.repeats} interleaved rounds"
    )
    leaves = _timing.input_leaves(model, batch)
    steps = [
        _timing.compile_step(fn, er.set_checkpoint(model, c), batch, leaves=leaves)
        for c in predicted
    ]
    # Each checkpoint's time: its median ratio, round by round, to the fastest.
    timings = _timing.time_steps(steps, args.repeats, on="fastest")
    return [
        {
            "group": name,
            "kind": "timed",
            "checkpoint": er.checkpoint_label(c),
            "uniform": not isinstance(c, er.ranges),
            "memory_bytes": memory,
            "measured_s": t.seconds,
            "spread": t.spread,
            "times_s": list(t.times),
            "predicted_s": p.time_s,
            "predicted_measured": p.measured,
            "roofline_s": er.internal.roofline_seconds(
                fn, *er.set_checkpoint((model, batch), c)
            ),
        }
        for (c, p), t, memory in zip(
            predicted.items(), timings, (s.memory_bytes for s in steps)
        )
    ]


def few_rounds(name: str, timed: list[dict], ks=(2, 3, 5)) -> dict[str, Any]:
    """How well `k` consecutive rounds rank the timed checkpoints: the rank
    correlation with the other rounds' medians (the mean over windows) by the
    mean of each one's faster half of rounds (the planner's) and by the paired
    ratio to the fastest (`on_one_clock`, the planner's before)."""
    times = np.array([r["times_s"] for r in timed])
    rounds = times.shape[1]
    row = {"group": name, "kind": "rounds", "rounds": rounds, "checkpoints": len(timed)}
    row |= {"k": [k for k in ks if k < rounds], "faster_half": [], "paired": []}
    for k in row["k"]:
        rhos: dict[str, list] = {"faster_half": [], "paired": []}
        for start in range(rounds - k + 1):
            window = np.s_[start : start + k]
            truth = np.median(np.delete(times, window, axis=1), 1)
            ts = [
                er.internal.Timing(np.median(x), 0.0, k, tuple(x))
                for x in times[:, window]
            ]
            pivot = min(range(len(ts)), key=lambda i: ts[i].seconds)
            paired = [t.seconds for t in er.internal.on_one_clock(ts, pivot)]
            rhos["faster_half"].append(
                _targets.spearman([t.faster_half for t in ts], truth)
            )
            rhos["paired"].append(_targets.spearman(paired, truth))
        for key, xs in rhos.items():
            row[key].append(float(np.mean([x for x in xs if x is not None])))
    return row


def _timing_of(row: dict) -> er.internal.Timing:
    """A "timed" row's rounds, as the `Timing` they were."""
    times = tuple(row["times_s"])
    return er.internal.Timing(row["measured_s"], row["spread"], len(times), times)


def _clock_pick(pick: dict, mine: dict, timed: list[dict]) -> None:
    """The pick's measured time (`mine`) beside the fastest uniform checkpoint
    that fits its budget, both from the same rounds."""
    pick["measured_s"], pick["spread"] = mine["measured_s"], mine["spread"]
    budget = pick["budget_bytes"]
    fitting = [r for r in timed if r["uniform"] and r["memory_bytes"] <= budget]
    if fitting:
        best = min(fitting, key=lambda r: r["measured_s"])
        pick["best_uniform_measured"] = best["checkpoint"]
        pick["best_uniform_measured_s"] = best["measured_s"]
        # Round by round: the two ran in the same rounds.
        pick["clock_ratio"] = er.internal.paired_ratio(
            _timing_of(mine), _timing_of(best)
        )
        pick["clock_between"] = _targets.between_measured(timed, budget)


def _frontier(plans: list[er.PlanResult]) -> list[dict[str, Any]]:
    """The points of every plan's frontier (compiled where one plan compiled
    it, else the latest plan's prediction) that no other beats in both memory
    and time, least memory first: rows without group and kind."""
    points = {}
    for r in plans:
        for p in r.frontier:
            old = points.get(p.checkpoint)
            if (
                old is None
                or p.compiled_bytes is not None
                or old.compiled_bytes is None
            ):
                points[p.checkpoint] = p
    rows = [
        {
            "checkpoint": er.checkpoint_label(p.checkpoint),
            "predicted_bytes": p.predicted_bytes,
            "compiled_bytes": p.compiled_bytes,
            "memory_bytes": (
                p.predicted_bytes if p.compiled_bytes is None else p.compiled_bytes
            ),
            "flops": p.flops,
            "host_bytes": p.host_bytes,
            "time_s": p.time_s,
        }
        for p in points.values()
    ]
    return _targets.pareto(rows, "time_s")


def _uniform_row(name: str, e: er.PlanEntry, cap: int) -> dict[str, Any]:
    return {
        "group": name,
        "kind": "uniform",
        "checkpoint": er.checkpoint_label(e.checkpoint),
        "memory_bytes": e.memory_bytes,
        "compiled": e.report is not None,
        **_planner.entry_fields(e, cap),
    }


def _pick_row(name, budget, result, uniform) -> dict[str, Any]:
    fitting = [e for e in uniform if e.report is not None and e.memory_bytes <= budget]
    best = min(fitting, key=lambda e: e.time_s, default=None)
    row = {
        "group": name,
        "kind": "pick",
        "budget_bytes": budget,
        "best_uniform": None if best is None else er.checkpoint_label(best.checkpoint),
        "best_uniform_time_s": None if best is None else best.time_s,
    }
    if result is None:
        return row | {"checkpoint": None, "fits": False}
    return row | {
        "checkpoint": er.checkpoint_label(result.checkpoint),
        **_planner.pick_fields(result, budget),
    }


RUN_ONLY = (*_cli.RUN_ONLY, "clock")  # --target: nothing is timed


def _names(args) -> list[str]:
    default = "seed-llama" if args.target else "transformer-s"
    return args.preset or ["transformer-tiny" if args.quick else default]


def depth_problem(args) -> str | None:
    """Why a `--checkpoint` cannot checkpoint a preset this run measures, or
    why a preset cannot be measured as asked."""
    for n in _names(args):
        if args.target and len(_models.PRESETS[n].stack_depths()) > 1:
            return (
                f"--preset {n}: a preset of several stacks is measured by the "
                "clock, against every combination of uniform checkpoints: run "
                "it without --target."
            )
    return _cli.presets_problem(args.checkpoint, _names(args))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _cli.parse_args(
        _parser(), argv, "plan_sweep", check=depth_problem, run_only=RUN_ONLY
    )
    console = _console.Console()
    names = _names(args)
    devices = _measure.mesh_for(args.target).size if args.target else 1
    presets = {n: _models.PRESETS[n].on(devices) for n in names}
    t0 = time.perf_counter()
    rows = [r for n, p in presets.items() for r in sweep_preset(args, n, p, console)]
    for r in of_kind(rows, "pick"):
        if r["group"] not in _plan_stacks.groups(rows):
            r["between"] = _targets.between_uniform(rows, r["group"], r["budget_bytes"])
    hw = er.internal.hardware(args.target)[0]  # the roofline's figures
    roofline = {"peak_flops": hw.peak_flops, "bytes_per_s": hw.memory_bytes_per_s}
    meta = _results.meta(args, seconds=time.perf_counter() - t0, roofline=roofline)
    where = args.target or args.platform
    described = {
        n: {"describe": p.describe(), "topology": where} for n, p in presets.items()
    }
    data = {"meta": meta, "presets": described, "rows": rows}
    # A run of presets of several stacks only has a results file of its own.
    stacks = all(len(p.stack_depths()) > 1 for p in presets.values())
    tag = (args.target or args.platform).replace(":", "_")
    return _ending.finish(
        args,
        console,
        data,
        stem=_results.stem(args, f"plan_sweep-stacks-{tag}" if stacks else None),
        plot=plot,
        show=show,
        presets=presets,
        targets=_targets.PLAN_TARGETS,
    )


@dataclasses.dataclass(frozen=True)
class Timed:
    """A checkpoint timed afresh (a row of kind "timed")."""

    group: str
    checkpoint: str
    memory_bytes: int
    measured_s: float
    spread: float | None
    predicted_s: float | None
    predicted_measured: bool
    roofline_s: float | None
    on_frontier: bool


C = _table.Column
ms, size = _format.fmt_ms, _format.fmt_bytes
PICKS: list[_table.Column[_planner.Pick]] = [
    *_planner.PLANNED,
    C("best uniform that fits", lambda r: r.best_uniform or "-", code=True),
    C("its est. time", lambda r: ms(r.best_uniform_time_s)),
    _planner.COMPILES,
]
"""Each budget's pick, on the console and in report.py."""
CLOCK: list[_table.Column[_planner.Pick]] = [
    C("preset", lambda r: r.group),
    C("budget", lambda r: size(r.budget_bytes)),
    C("pick", lambda r: r.checkpoint, code=True),
    C("measured", lambda r: ms(r.measured_s)),
    C("fastest fitting uniform", lambda r: r.best_uniform_measured, code=True),
    C("it, measured", lambda r: ms(r.best_uniform_measured_s)),
    C("pick / it", lambda r: f"{r.clock_ratio:.3f}x"),
]
"""Each pick by the clock, beside the fastest fitting uniform checkpoint."""
TIMED: list[_table.Column[Timed]] = [
    C("preset", lambda r: r.group),
    C("checkpoint", lambda r: r.checkpoint, code=True),
    C("memory", lambda r: size(r.memory_bytes)),
    C("measured", lambda r: ms(r.measured_s)),
    C("spread", lambda r: _format.fmt_pct(r.spread)),
    C("predicted", lambda r: ms(r.predicted_s) + ("" if r.predicted_measured else "*")),
    C("roofline", lambda r: ms(r.roofline_s)),
    C("on the frontier", lambda r: "yes" if r.on_frontier else ""),
]
"""Every checkpoint timed afresh: predicted against measured."""
TIMED_NOTE = (
    "predicted: the planner's time (* estimated: a mix from its options' "
    "measured times per layer); roofline: FLOPs at peak + bytes moved at "
    "bandwidth, the device's figures (a CPU's by calibration); spread: "
    "interquartile range / median"
)


def tables(data: dict) -> dict[str, tuple[list[_table.Column], list]]:
    """The sweep's tables, on the console and in report.py: title -> (its
    columns, its rows)."""
    rows, stacked = data["rows"], _plan_stacks.groups(data["rows"])
    mine = [r for r in of_kind(rows, "pick") if r["group"] not in stacked]
    picks = _table.read_all(_planner.Pick, mine)
    timed = _table.read_all(Timed, of_kind(rows, "timed"))
    timed.sort(key=lambda r: (r.group, r.memory_bytes))
    out = {"Picks": (PICKS, picks)} if picks or not stacked else {}
    if timed:
        clocked = [r for r in picks if r.best_uniform_measured_s]
        out["By the clock (every pick and uniform checkpoint timed afresh, "
            "round-robin)"] = (CLOCK, clocked)  # fmt: skip
        out["Timed afresh: predicted against measured"] = (TIMED, timed)
    if stacked:
        out |= _plan_stacks.tables(rows, stacked)
    return out


def _planning(data: dict) -> list[str]:
    """What planning cost, per preset."""
    cpus = data["meta"]["cpu_count"]
    return [
        f"`{r['group']}`: {data['presets'][r['group']]['describe']}, "
        f"{data['presets'][r['group']]['topology']}. Planning {r['budgets']} "
        f"budgets: {r['compiles']} compiles, {r['seconds']:.0f} s, "
        f"{r.get('cpu_seconds', 0):.0f} s of CPU (load average "
        f"{r['load_average']:.1f} on a {cpus}-core host)"
        for r in of_kind(data["rows"], "planning")
    ]


def _rounds(data: dict) -> list[str]:
    """How well a few rounds rank the checkpoints (the planner's statistic,
    the faster half of rounds, beside the paired ratio)."""
    return [
        f"{r['group']}: rank correlation of k of {r['rounds']} rounds with the "
        "other rounds' medians: "
        + ", ".join(
            f"k={k}: faster half {f:.2f}, paired ratio {m:.2f}"
            for k, f, m in zip(r["k"], r["faster_half"], r["paired"])
        )
        for r in of_kind(data["rows"], "rounds")
    ]


def show(console: _console.Console, data: dict, where: str) -> None:
    for n, p in data["presets"].items():
        console.print(f"[bold]{n}[/]: {p['describe']}")
    cols = ("preset", "checkpoint", "memory", "FLOPs", "host", "est. time", "compiled")
    cells = [
        (
            r["group"],
            r["checkpoint"],
            _format.fmt_bytes(r["memory_bytes"]),
            _format.fmt_flops(r["flops"]),
            _format.fmt_bytes(r["host_bytes"]) if r["host_bytes"] else "-",
            _format.fmt_ms(r["time_s"]),
            "yes" if r["compiled"] else "no (XLA: does not fit)",
        )
        for r in of_kind(data["rows"], "uniform")
    ]
    if cells:
        console.table(f"Uniform candidates [{where}]", cols, cells)
    for title, (columns, rows) in tables(data).items():
        _table.show(console, f"{title} [{where}]", columns, rows)
    if of_kind(data["rows"], "timed"):
        console.print(TIMED_NOTE)
    for line in _rounds(data) + _planning(data):
        console.print(line)


def report(data: dict) -> str:
    """report.py's section: what planning cost, the tables, the few rounds,
    the targets."""
    parts = ["\n".join(f"- {line}" for line in _planning(data))]
    for title, (columns, rows) in tables(data).items():
        parts.append(f"{title}:\n\n{_table.markdown(columns, rows)}")
    if of_kind(data["rows"], "timed"):
        parts.append(TIMED_NOTE[0].upper() + TIMED_NOTE[1:] + ".")
    parts += ["\n".join(f"- {line}" for line in _rounds(data))]
    return "\n\n".join([p for p in parts if p] + [_table.targets_markdown(data)])


def plot(data: dict, path: Path) -> None:
    """Per preset: memory against step time (measured, or estimated for a
    target); on the device, under it, predicted (and roofline) against
    measured time."""
    groups, clock = list(data["presets"]), bool(of_kind(data["rows"], "timed"))
    stacked = _plan_stacks.groups(data["rows"])
    n = 2 if clock else 1
    size = (7 * len(groups), 4.6 * n)
    fig, axes = _plots.plt().subplots(n, len(groups), figsize=size, squeeze=False)
    points = []
    for i, g in enumerate(groups):
        rows = [r for r in data["rows"] if r["group"] == g]
        p = data["presets"][g]
        title = textwrap.fill(f"{g}: {p['describe']} [{p['topology']}]", 95)
        draw = _plan_stacks.panel if g in stacked else _panel
        points.append(draw(axes[0][i], rows, title))
        if clock:
            _plot_clock(axes[1][i], of_kind(rows, "timed"), g)
    timed = clock or any(r.get("measured_s") for r in of_kind(data["rows"], "pick"))
    how = "measured on the device" if timed else "estimated by the roofline"
    rivals = (
        "every combination of uniform checkpoints per stack"
        if set(groups) <= stacked
        else "the uniform candidates"
    )
    _plots.suptitle(
        fig,
        f"Planner sweep: each budget's pick and {rivals}, memory "
        f"against step time ({how})\n{_plots.where_when(data['meta'])}",
    )
    fig.tight_layout()
    for ax, (labelled, others) in zip(axes[0], points):
        _plots.label_points(ax, labelled, others, fontsize=7)
    _plots.save_figure(fig, path)


def _panel(ax, rows: list[dict], title: str) -> tuple[list, list]:
    """Uniform candidates grey, the frontier a line, the budgets dotted, the
    picks starred. Returns `[labelled, others]` for `_plots.label_points`: the
    uniform candidates, and the frontier's and the picks' points."""
    uniform = [r for r in of_kind(rows, "uniform") if r["compiled"]]
    frontier = of_kind(rows, "frontier")
    picks = [r for r in of_kind(rows, "pick") if r["checkpoint"]]
    budgets = [r["budget_bytes"] for r in of_kind(rows, "pick")]
    memories = [r["memory_bytes"] for r in uniform + frontier] + budgets
    unit, size = _plots.byte_unit(memories)
    _planner.budget_lines(ax, budgets, size)
    xs = [r["memory_bytes"] / size for r in uniform]
    ys = [1e3 * r["time_s"] for r in uniform]
    ax.scatter(xs, ys, color="0.55", s=28, label="uniform candidates", zorder=2)
    labelled = [(x, y, r["checkpoint"]) for x, y, r in zip(xs, ys, uniform)]
    xs = [r["memory_bytes"] / size for r in frontier]
    ys = [1e3 * r["time_s"] for r in frontier]
    line = {"color": "tab:blue", "lw": 1.6, "marker": ".", "zorder": 3}
    ax.plot(xs, ys, label="planner's frontier", **line)
    others = list(zip(xs, ys))
    xs = [r["compiled_bytes"] / size for r in picks]
    ys = [1e3 * r["time_s"] for r in picks]
    _planner.picks(
        ax,
        xs,
        ys,
        "pick at each budget (compiled)",
        title,
        xlabel=f"device memory per chip ({unit}): args + outputs + temporaries",
        ylabel="step time (ms): measured, or estimated",
    )
    return labelled, others + list(zip(xs, ys))


def _plot_clock(ax, timed: list[dict], group: str) -> None:
    """Predicted and roofline (rescaled) time against measured, each with the
    rounds' interquartile range; the diagonal is exact."""
    if not timed:
        ax.set_visible(False)
        return
    ms = [1e3 * r["measured_s"] for r in timed]
    err = [1e3 * r["measured_s"] * r["spread"] for r in timed]
    predicted = [1e3 * r["predicted_s"] for r in timed]
    roofline = [1e3 * r["roofline_s"] for r in timed]
    scale = sum(ms) / max(sum(roofline), 1e-12)  # the roofline's own: rescaled
    for ys, color, label in (
        (predicted, "tab:blue", "planner's predicted time"),
        ([scale * y for y in roofline], "tab:orange", "roofline alone (rescaled)"),
    ):
        ax.errorbar(
            ms, ys, xerr=err, fmt="o", ms=4, color=color, alpha=0.8, label=label
        )
    lo, hi = min(ms) * 0.95, max(ms) * 1.05
    ax.plot([lo, hi], [lo, hi], color="0.5", lw=0.8, ls="--", label="exact")
    rho = _targets.spearman(
        [r["predicted_s"] for r in timed], [r["measured_s"] for r in timed]
    )
    _planner.finish(
        ax,
        f"{group}: predicted against measured "
        f"(Spearman: {'n/a' if rho is None else f'{rho:.2f}'})",
        xlabel="measured step time (ms), median of interleaved rounds",
        ylabel="predicted step time (ms)",
    )


if __name__ == "__main__":
    main()

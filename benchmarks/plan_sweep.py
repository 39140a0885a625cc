"""The planner's frontier: `eqx_remat.plan` at budgets swept from the smallest
memory its options reach to `None`'s, each pick beside every uniform candidate.

For each preset, the gradient of its loss (FSDP presets: the gradient kept
sharded like the parameters) is planned at `--budgets` evenly spaced budgets,
from the compiled memory of the lightest per-layer option to that of `None`
(on TPU v5e at most one chip's 16 GiB; on the device, 1.1x `None`'s, and also
half-way between neighbouring uniform points of the first plan's frontier,
where a mix can win), with one function object, so the
planner reuses its own compilations as a user planning several budgets would;
its compile count and wall time are recorded. Then the uniform candidates
(the preset's checkpoints) are compiled with `plan(candidates=...)`, the same
estimated step time. The targets (`_targets.PLAN_TARGETS`) are evaluated on
the picks: each fits when compiled, costs no more than the best uniform
candidate that fits, costs less at half or more of the budgets between uniform
points, and was predicted within 5% of its compiled memory.

On the device it runs on (no `--target`), the planner times what it compiles,
and the sweep then checks it against the clock: every frontier point, every
pick and every uniform checkpoint that any plan compiled or the preset lists
is compiled again and timed in this process, `--repeats` interleaved rounds
after a warm-up (each one's time: its median ratio within a round to the
fastest's, times the fastest's median). The targets: at every budget the
pick's measured time is at most 1.03x that of the fastest uniform checkpoint
that fits (measured in the same rounds), strictly less at half or more of the
budgets between uniform points; the planner's predicted times rank the
frontier as the measured ones do (Spearman >= 0.9), and so does the roofline
alone (>= 0.8, this CPU's own figures). `--no-clock` skips this.

    python benchmarks/plan_sweep.py                                 # transformer-s, CPU
    python benchmarks/plan_sweep.py --preset transformer-s transformer-w  # + 8x FLOPs
    python benchmarks/plan_sweep.py --target v5e:2x4 --preset seed-llama  # v5e AOT
    python benchmarks/plan_sweep.py --quick                         # tiny (tests)

The plot: memory against step time (measured, or estimated for a target
compiled ahead of time); uniform candidates grey, the planner's frontier a
line, the budgets dotted, the picks marked; on the device, a second panel per
preset: predicted (and roofline) against measured time.
"""

import argparse
import contextlib
import functools
import os
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

import eqx_remat as er
import zoo
from benchmarks import _common, _measure, _models, _targets


def _parser() -> argparse.ArgumentParser:
    p = _common.parser(__doc__, presets=list(_models.PRESETS), repeats=25)
    p.add_argument(
        "--no-clock",
        dest="clock",
        action="store_false",
        help="on the device: do not time the frontier, picks and uniform "
        "checkpoints afresh (default: time them)",
    )
    _common.int_flag(p, "--budgets", 10, "how many budgets, evenly spaced")
    return p


def _step(preset: _models.Preset, mesh: Any):
    """The function planned: the gradient of the preset's loss with respect to
    the model (kept sharded like the parameters under FSDP)."""
    grad = eqx.filter_grad(preset.loss)
    if mesh is None or not preset.fsdp:
        return grad

    def fsdp_grad(model, batch):
        return zoo.shard(grad(model, batch), mesh, fsdp=True)

    return fsdp_grad


def _point(p: er.FrontierPoint) -> dict[str, Any]:
    return {
        "checkpoint": _common.checkpoint_label(p.checkpoint),
        "predicted_bytes": p.predicted_bytes,
        "compiled_bytes": p.compiled_bytes,
        "memory_bytes": _common.point_memory(p),
        "flops": p.flops,
        "host_bytes": p.host_bytes,
        "time_s": p.time_s,
    }


def _sweep_budgets(args, fn, model, batch, top: er.PlanResult, cap: int) -> list[int]:
    """The budgets to plan: `--budgets` evenly spaced (both ends included) from
    the smallest compiled memory on the frontier of `top` (the plan at `cap`:
    it compiles the lightest option) to `None`'s memory (on the device 1.1x
    that, where it fits too), or `cap` where `None` needs more (or XLA refuses
    it); and on the device half-way between the first plan's uniform points
    too."""
    try:
        none = er.plan(
            fn, model, batch, budget_bytes=cap, target=args.target, candidates=[None]
        ).entry.memory_bytes
    except ValueError:  # None does not fit one device (XLA refuses it)
        none = None
    above = 1.0 if args.target else 1.1
    low = min(p.compiled_bytes for p in top.frontier if p.compiled_bytes)
    high = min(cap, int(none * above)) if none else cap
    if args.budgets == 1 or high <= low:
        budgets = [high]
    else:
        budgets = [int(round(b)) for b in np.linspace(low, high, args.budgets)]
    if not args.target:
        budgets = sorted(set(budgets) | set(_between(top)))
    return budgets


def _between(top: er.PlanResult) -> list[int]:
    """Half-way between neighbours among the compiled uniform points of the
    frontier of `top` (by the clock, on the device): where a mix of two
    options can be faster than any single one that fits. Points less than 1%
    apart are one point here: a mix between them has less room than the
    planner's memory predictions may miss (they are held to 5%)."""
    memories = sorted(
        p.compiled_bytes
        for p in top.frontier
        if p.compiled_bytes and not isinstance(p.checkpoint, er.ranges)
    )
    return [(lo + hi) // 2 for lo, hi in zip(memories, memories[1:]) if hi > 1.01 * lo]


def _plan(fn, model, batch, budget, target) -> er.PlanResult | None:
    """The planner's answer, or `None` where nothing fits the budget."""
    try:
        return er.plan(fn, model, batch, budget_bytes=budget, target=target)
    except ValueError as e:
        if "fits" not in str(e):
            raise
        return None


def sweep_preset(args, name: str, preset: _models.Preset, console) -> list[dict]:
    """Plan every budget (timed, compiles counted), then compile the uniform
    candidates: the rows of one preset."""
    mesh = _measure.mesh_for(args.target) if args.target else None
    model = preset.build(abstract=True)
    batch = preset.inputs(abstract=True)
    if mesh is not None:
        model = zoo.shard(model, mesh, fsdp=preset.fsdp)
        batch = _measure.place_batch(batch, mesh)
    fn = _step(preset, mesh)
    cap = _measure.V5E_HBM if args.target else 2**50
    # The flash kernel finds the mesh to shard_map over in the context.
    flash = mesh is not None and getattr(preset, "attention", None) == "flash"
    with jax.set_mesh(mesh) if flash else contextlib.nullcontext():
        load0, t0, cpu0 = os.getloadavg()[0], time.perf_counter(), time.process_time()
        console.print(f"[bold]{name}[/]: planning at {_common.fmt_bytes(cap)} first")
        top = _plan(fn, model, batch, cap, args.target)
        if top is None:
            raise SystemExit(f"{name}: nothing fits in {_common.fmt_bytes(cap)}")
        specs = args.checkpoint or preset.checkpoints(
            quick=args.quick, accelerator=bool(args.target)
        )
        cands = [_common.parse_checkpoint(s, preset.depth) for s in specs]
        budgets = _sweep_budgets(args, fn, model, batch, top, cap)
        results = []
        for b in budgets:
            if b == cap:  # planned already
                results.append(top)
                continue
            console.print(f"[bold]{name}[/]: budget {_common.fmt_bytes(b)}")
            results.append(_plan(fn, model, batch, b, args.target))
        # In the order planned: later calls predict with more compiles behind them.
        calls = ([] if cap in budgets else [top]) + results
        plans = [r for r in calls if r is not None]  # None: nothing fits
        planning = {
            "group": name,
            "kind": "planning",
            "budgets": len(budgets),
            "calls": len(calls),
            "compiles": sum(r.compiles for r in plans),
            "seconds": time.perf_counter() - t0,
            # Every thread's: the compiler's too.
            "cpu_seconds": time.process_time() - cpu0,
            "load_average": (load0 + os.getloadavg()[0]) / 2,
        }
        console.print(
            f"[bold]{name}[/]: planned {len(budgets)} budgets in "
            f"{planning['seconds']:.0f} s ({planning['cpu_seconds']:.0f} s of CPU, "
            f"load average {planning['load_average']:.1f}), "
            f"{planning['compiles']} compiles; uniform candidates next"
        )
        uniform = er.plan(
            fn, model, batch, budget_bytes=cap, target=args.target, candidates=cands
        ).table
        timed = []
        if args.clock and not args.target:
            timed = clock_rows(args, name, fn, model, batch, plans, uniform, console)
    rows = [planning, *(_uniform_row(name, e, cap) for e in uniform)]
    rows += [_pick_row(name, b, r, uniform) for b, r in zip(budgets, results)]
    frontier = _frontier(plans)
    rows += [{"group": name, "kind": "frontier", **p} for p in frontier]
    if timed:
        on = {p["checkpoint"] for p in frontier}
        for r in timed:
            r["on_frontier"] = r["checkpoint"] in on
        rows += timed
        rows.append(few_rounds(name, timed))
        by = {r["checkpoint"]: r for r in timed}
        for r in rows:
            if r["kind"] == "pick" and r.get("checkpoint") in by:
                _clock_pick(r, by, timed)
    return rows


def clock_rows(args, name, fn, model, batch, plans, uniform, console) -> list[dict]:
    """Every frontier point, pick and uniform checkpoint of the plans (and the
    preset's uniform candidates), compiled and timed afresh in this process,
    round-robin: a row each, with the planner's predicted time beside the
    measured one and the roofline's."""
    predicted: dict[Any, er.FrontierPoint | er.PlanEntry] = {}
    for r in plans:
        predicted.update((p.checkpoint, p) for p in r.frontier)
        predicted.setdefault(r.checkpoint, r.entry)
    for e in uniform:
        predicted.setdefault(e.checkpoint, e)
    checkpoints = list(predicted)
    console.print(
        f"[bold]{name}[/]: timing {len(checkpoints)} checkpoints afresh, "
        f"{args.repeats} interleaved rounds"
    )
    _, dynamic = er.internal.traceable(fn, (model, batch))
    leaves = jax.tree.leaves(er.internal.concrete(dynamic))
    programs, reports = [], []
    for c in checkpoints:
        args_c = er.set_checkpoint((model, batch), c)
        f, dyn = er.internal.traceable(fn, args_c)
        exe = jax.jit(f).lower(dyn).compile()
        reports.append(
            er.internal.compiled_report(exe, flops=0, target=jax.default_backend())
        )
        inputs = jax.tree.unflatten(jax.tree.structure(dyn), leaves)
        programs.append(functools.partial(exe, inputs))
    timings = er.internal.time_interleaved(programs, rounds=args.repeats)
    # Each checkpoint's time: its median ratio, round by round, to the fastest.
    fastest = min(range(len(timings)), key=lambda i: timings[i].seconds)
    timings = er.internal.on_one_clock(timings, fastest)
    rows = []
    for c, t, report in zip(checkpoints, timings, reports):
        p = predicted[c]
        rows.append(
            {
                "group": name,
                "kind": "timed",
                "checkpoint": _common.checkpoint_label(c),
                "uniform": not isinstance(c, er.ranges),
                "memory_bytes": report.total_bytes,
                "measured_s": t.seconds,
                "spread": t.spread,
                "times_s": list(t.times),
                "predicted_s": p.time_s,
                "predicted_measured": p.measured,
                "roofline_s": er.internal.roofline_seconds(
                    fn, *er.set_checkpoint((model, batch), c)
                ),
            }
        )
    return rows


def few_rounds(name: str, timed: list[dict], ks=(2, 3, 5)) -> dict[str, Any]:
    """How well `k` rounds rank the timed checkpoints, as the planner has few:
    over every `k` consecutive rounds of the clock's, the rank correlation
    with the other rounds' medians of each checkpoint's time by two
    statistics of those `k` rounds: the mean of its faster half of rounds
    (the planner's, `Timing.faster_half`), and its median ratio, round by
    round, to the fastest checkpoint's (the planner's before it,
    `on_one_clock`); the mean over the windows."""
    times = np.array([r["times_s"] for r in timed])
    rounds = times.shape[1]

    def paired(t: np.ndarray) -> list[float]:
        ts = [er.internal.Timing(float(np.median(x)), 0.0, len(x), tuple(x)) for x in t]
        pivot = min(range(len(ts)), key=lambda i: ts[i].seconds)
        return [x.seconds for x in er.internal.on_one_clock(ts, pivot)]

    def faster_half(t: np.ndarray) -> list[float]:
        return [er.internal.Timing(0.0, 0.0, len(x), tuple(x)).faster_half for x in t]

    row: dict[str, Any] = {"group": name, "kind": "rounds", "rounds": rounds}
    row["checkpoints"] = len(timed)
    row["k"], row["faster_half"], row["paired"] = [], [], []
    for k in (k for k in ks if k < rounds):
        ours, before = [], []
        for start in range(rounds - k + 1):
            window = times[:, start : start + k]
            truth = np.median(np.delete(times, np.s_[start : start + k], axis=1), 1)
            ours.append(_targets.spearman(faster_half(window), truth))
            before.append(_targets.spearman(paired(window), truth))
        row["k"].append(k)
        row["faster_half"].append(float(np.mean([x for x in ours if x is not None])))
        row["paired"].append(float(np.mean([x for x in before if x is not None])))
    return row


def _timing(row: dict) -> er.internal.Timing:
    return er.internal.Timing(
        row["measured_s"], row["spread"], len(row["times_s"]), tuple(row["times_s"])
    )


def _clock_pick(pick: dict, by: dict, timed: list[dict]) -> None:
    """The pick's measured time beside the fastest uniform checkpoint that
    fits its budget, both from the same rounds."""
    fitting = [
        r for r in timed if r["uniform"] and r["memory_bytes"] <= pick["budget_bytes"]
    ]
    mine = by[pick["checkpoint"]]
    pick["measured_s"], pick["spread"] = mine["measured_s"], mine["spread"]
    if fitting:
        best = min(fitting, key=lambda r: r["measured_s"])
        pick["best_uniform_measured"] = best["checkpoint"]
        pick["best_uniform_measured_s"] = best["measured_s"]
        # Round by round: the two ran in the same rounds.
        pick["clock_ratio"] = er.internal.paired_ratio(_timing(mine), _timing(best))
        pick["clock_between"] = _targets.between_measured(timed, pick["budget_bytes"])


def _frontier(plans: list[er.PlanResult]) -> list[dict[str, Any]]:
    """The points of every plan's frontier (compiled where one plan compiled
    it, else the latest plan's prediction) that no other beats in both memory
    and time, least memory first, as rows (`_point`)."""
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
    return _targets.pareto([_point(p) for p in points.values()], "time_s")


def _entry(e: er.PlanEntry, budget: int) -> dict[str, Any]:
    """A plan's entry: whether it fits `budget` when compiled, its cost."""
    compiled = e.report is not None
    return {
        "fits": compiled and e.memory_bytes <= budget,
        "flops": e.flops,
        "host_bytes": e.report.host_temp_bytes if compiled else 0,
        "time_s": e.time_s,
    }


def _uniform_row(name: str, e: er.PlanEntry, cap: int) -> dict[str, Any]:
    return {
        "group": name,
        "kind": "uniform",
        "checkpoint": _common.checkpoint_label(e.checkpoint),
        "memory_bytes": e.memory_bytes,
        "compiled": e.report is not None,
        **_entry(e, cap),
    }


def _pick_row(name, budget, result, uniform) -> dict[str, Any]:
    fitting = [e for e in uniform if e.report is not None and e.memory_bytes <= budget]
    best = min(fitting, key=lambda e: e.time_s) if fitting else None
    row = {
        "group": name,
        "kind": "pick",
        "budget_bytes": budget,
        "best_uniform": None
        if best is None
        else _common.checkpoint_label(best.checkpoint),
        "best_uniform_time_s": None if best is None else best.time_s,
    }
    if result is None:
        return row | {"checkpoint": None, "fits": False}
    (point,) = [p for p in result.frontier if p.checkpoint == result.checkpoint] or [
        None
    ]
    e = result.entry
    return row | {
        "checkpoint": _common.checkpoint_label(result.checkpoint),
        "compiled_bytes": e.memory_bytes,
        "predicted_bytes": None if point is None else point.predicted_bytes,
        **_entry(e, budget),
        "compiles": result.compiles,
        "seconds": result.seconds,
        "notes": list(result.notes),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _common.parse_args(_parser(), argv, "plan_sweep")
    console = _common.Console()
    names = args.preset or (
        ["transformer-tiny"]
        if args.quick
        else ["seed-llama"]
        if args.target
        else ["transformer-s"]
    )
    devices = _measure.mesh_for(args.target).size if args.target else 1
    presets = {n: _models.PRESETS[n].on(devices) for n in names}
    t0 = time.perf_counter()
    rows = []
    for name, preset in presets.items():
        rows += sweep_preset(args, name, preset, console)
    for r in rows:
        if r["kind"] == "pick":
            r["between"] = _targets.between_uniform(rows, r["group"], r["budget_bytes"])
    hw = er.internal.hardware(args.target)[0]  # the roofline's figures
    data = {
        "meta": _common.meta(
            args,
            seconds=time.perf_counter() - t0,
            roofline={
                "peak_flops": hw.peak_flops,
                "bytes_per_s": hw.memory_bytes_per_s,
            },
        ),
        "presets": {
            n: {"describe": p.describe(), "topology": args.target or args.platform}
            for n, p in presets.items()
        },
        "rows": rows,
    }
    tag = (args.target or args.platform).replace(":", "_")
    stem = f"plan_sweep-{tag}" + ("-quick" if args.quick else "")
    if _common.is_main():  # what was measured, before anything else can fail
        _common.write_json(args.out / f"{stem}.json", data)
    data["targets"] = _targets.evaluate(rows, presets, _targets.PLAN_TARGETS)
    path = _common.write(args, stem, data, plot)
    show(console, data, _common.where(args, data))
    console.print(f"results in {path}")
    return data


def show(console: _common.Console, data: dict, where: str) -> None:
    for n, p in data["presets"].items():
        console.print(f"[bold]{n}[/]: {p['describe']}")
    rows = data["rows"]
    console.table(
        f"Uniform candidates [{where}]",
        ("preset", "checkpoint", "memory", "FLOPs", "host", "est. time", "compiled"),
        [
            (
                r["group"],
                r["checkpoint"],
                _common.fmt_bytes(r["memory_bytes"]),
                _common.fmt_flops(r["flops"]),
                _common.fmt_bytes(r["host_bytes"]) if r["host_bytes"] else "-",
                _common.fmt_ms(r["time_s"]),
                "yes" if r["compiled"] else "no (XLA: does not fit)",
            )
            for r in rows
            if r["kind"] == "uniform"
        ],
    )
    cols = ("preset", "budget", "pick", "compiled", "predicted", "est. time")
    cols += ("best uniform", "its time", "compiles")
    picks = [r for r in rows if r["kind"] == "pick"]
    cells = [[*_common.pick_cells(r, "{}"), r.get("compiles", "-")] for r in picks]
    console.table(f"Picks [{where}]", cols, cells)
    _show_timed(console, rows, where)
    for r in rows:
        if r["kind"] == "planning":
            console.print(
                f"{r['group']}: planning {r['budgets']} budgets: {r['compiles']} "
                f"compiles, {r['seconds']:.0f} s, {r['cpu_seconds']:.0f} s of CPU "
                f"(load average {r['load_average']:.1f})"
            )
    _common.show_targets(console, data["targets"])


def _show_timed(console: _common.Console, rows: list[dict], where: str) -> None:
    """Every checkpoint timed afresh: measured, predicted and roofline."""
    timed = [r for r in rows if r["kind"] == "timed"]
    if not timed:
        return
    console.table(
        f"Timed afresh [{where}]: predicted against measured",
        _common.TIMED_COLUMNS,
        [
            _common.timed_cells(r, "{}", "*")
            for r in sorted(timed, key=lambda r: (r["group"], r["memory_bytes"]))
        ],
    )
    console.print(
        "predicted: the planner's time (* estimated: a mix from its options' "
        "measured times per layer); roofline: FLOPs at peak + bytes moved at "
        "bandwidth, the device's figures (a CPU's by calibration); spread: "
        "interquartile range / median"
    )
    for r in rows:
        if r["kind"] == "rounds":
            console.print(
                f"{r['group']}: rank correlation of k of {r['rounds']} rounds with "
                "the other rounds' medians: "
                + ", ".join(
                    f"k={k}: faster half {f:.2f}, paired ratio {m:.2f}"
                    for k, f, m in zip(r["k"], r["faster_half"], r["paired"])
                )
            )


def plot(data: dict, path: Path) -> None:
    """Per preset: memory against step time; on the device, under it,
    predicted (and roofline) against measured time."""
    pyplot = _common.plt()
    groups = list(data["presets"])
    clock = any(r["kind"] == "timed" for r in data["rows"])
    fig, axes = pyplot.subplots(
        2 if clock else 1,
        len(groups),
        figsize=(7 * len(groups), 9.2 if clock else 4.6),
        squeeze=False,
    )
    for i, g in enumerate(groups):
        rows = [r for r in data["rows"] if r["group"] == g]
        _plot_preset(axes[0][i], rows, data, g)
        if clock:
            _plot_clock(axes[1][i], rows, g)
    _common.save_figure(fig, path)


def _plot_clock(ax, rows: list[dict], group: str) -> None:
    """Predicted and roofline time against measured, each point with its
    spread (interquartile range of the rounds); the diagonal is exact."""
    timed = [r for r in rows if r["kind"] == "timed"]
    if not timed:
        ax.set_visible(False)
        return
    ms = [1e3 * r["measured_s"] for r in timed]
    err = [1e3 * r["measured_s"] * r["spread"] for r in timed]
    for key, color, label in (
        ("predicted_s", "tab:blue", "planner's predicted time"),
        ("roofline_s", "tab:orange", "roofline alone (rescaled)"),
    ):
        ys = [1e3 * r[key] for r in timed]
        if key == "roofline_s":  # the roofline's own scale: shown rescaled
            k = sum(ms) / max(sum(ys), 1e-12)
            ys = [k * y for y in ys]
        ax.errorbar(
            ms, ys, xerr=err, fmt="o", ms=4, color=color, alpha=0.8, label=label
        )
    lo, hi = min(ms) * 0.95, max(ms) * 1.05
    ax.plot([lo, hi], [lo, hi], color="0.5", lw=0.8, ls="--", label="exact")
    rho = _targets.spearman(
        [r["predicted_s"] for r in timed], [r["measured_s"] for r in timed]
    )
    ax.set(
        xlabel="measured step time (ms), median of interleaved rounds",
        ylabel="predicted step time (ms)",
        title=f"{group}: predicted against measured "
        f"(Spearman: {'n/a' if rho is None else f'{rho:.2f}'})",
    )
    ax.title.set_fontsize(8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _plot_preset(ax, rows: list[dict], data: dict, group: str) -> None:
    uniform = [r for r in rows if r["kind"] == "uniform" and r["compiled"]]
    frontier = [r for r in rows if r["kind"] == "frontier"]
    picks = [r for r in rows if r["kind"] == "pick" and r["checkpoint"]]
    budgets = [r["budget_bytes"] for r in rows if r["kind"] == "pick"]
    top = max([r["memory_bytes"] for r in uniform + frontier] + budgets)
    unit, size = ("GiB", _common.GiB) if top >= _common.GiB else ("MiB", _common.MiB)
    for b in budgets:
        ax.axvline(b / size, color="0.6", lw=0.8, ls=":", zorder=0)
    xs = [r["memory_bytes"] / size for r in uniform]
    ys = [1e3 * r["time_s"] for r in uniform]
    ax.scatter(xs, ys, color="0.55", s=28, label="uniform candidates", zorder=2)
    # Points closer than 2% of the axes share one label ("None = everything").
    dx, dy = 0.02 * (max(xs) - min(xs) or 1), 0.02 * (max(ys) - min(ys) or 1)
    labels: dict[tuple, list[str]] = {}
    for x, y, r in zip(xs, ys, uniform):
        near = [k for k in labels if abs(k[0] - x) < dx and abs(k[1] - y) < dy]
        labels.setdefault(near[0] if near else (x, y), []).append(r["checkpoint"])
    for (x, y), names in labels.items():
        ax.annotate(
            " = ".join(names),
            (x, y),
            fontsize=7,
            color="0.35",
            xytext=(4, 3),
            textcoords="offset points",
        )
    ax.plot(
        [r["memory_bytes"] / size for r in frontier],
        [1e3 * r["time_s"] for r in frontier],
        color="tab:blue",
        lw=1.6,
        marker=".",
        label="planner's frontier",
        zorder=3,
    )
    ax.scatter(
        [r["compiled_bytes"] / size for r in picks],
        [1e3 * r["time_s"] for r in picks],
        marker="*",
        s=110,
        color="tab:red",
        label="pick at each budget (compiled)",
        zorder=4,
    )
    ax.plot([], [], color="0.6", lw=0.8, ls=":", label="budgets")
    ax.set(
        xlabel=f"device memory per chip ({unit}): args + outputs + temporaries",
        ylabel="step time (ms): measured, or estimated",
        title=f"{group}: {data['presets'][group]['describe']} "
        f"[{data['presets'][group]['topology']}]",
    )
    ax.title.set_fontsize(8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


if __name__ == "__main__":
    main()

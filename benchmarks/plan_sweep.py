"""The planner's frontier: `eqx_remat.plan` at `--budgets` budgets, from its
lightest option's compiled memory to `None`'s, each pick beside every uniform
candidate; on the device, every frontier point, pick and uniform checkpoint is
then timed afresh in `--repeats` interleaved rounds (`--no-clock`: not). A
preset of several stacks (`encoder-decoder`) is planned the same way, and each
pick is timed beside every combination of one uniform candidate per stack. How
the budgets are chosen and what the targets ask: benchmarks/README.md.

    python benchmarks/plan_sweep.py                                 # transformer-s, CPU
    python benchmarks/plan_sweep.py --preset transformer-s transformer-w  # + 8x FLOPs
    python benchmarks/plan_sweep.py --preset encoder-decoder        # two stacks
    python benchmarks/plan_sweep.py --target v5e:2x4 --preset seed-llama  # v5e AOT
    python benchmarks/plan_sweep.py --quick                         # tiny (tests)
"""

import argparse
import contextlib
import dataclasses
import functools
import itertools
import os
import textwrap
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
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
    _plots,
    _results,
    _table,
    _targets,
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


def _step(preset: _models.Preset, mesh: Any) -> Callable:
    """The function planned: the gradient of the preset's loss (under FSDP kept
    sharded like the parameters)."""
    grad = eqx.filter_grad(preset.loss)
    if mesh is None or not preset.fsdp:
        return grad
    return lambda model, batch: zoo.shard(grad(model, batch), mesh, fsdp=True)


def _plan(fn, model, batch, budget: int, target) -> er.PlanResult | None:
    """The planner's answer, or `None` where nothing fits the budget."""
    try:
        return er.plan(fn, model, batch, budget_bytes=budget, target=target)
    except ValueError as e:
        if "fits" not in str(e):
            raise
        return None


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


def _plan_budgets(args, name, fn, model, batch, cap: int, console, choose=None):
    """Plan at `cap`, then at each budget (`choose(top)`, the plan at `cap`
    given; default `_budgets`) with the same function object (the planner
    reuses its compilations): the "planning" row, the budgets, each one's plan
    (`None`: nothing fits) and every plan made, in order."""
    load0, t0, cpu0 = os.getloadavg()[0], time.perf_counter(), time.process_time()
    console.print(f"[bold]{name}[/]: planning at {_format.fmt_bytes(cap)} first")
    top = _plan(fn, model, batch, cap, args.target)
    if top is None:
        raise SystemExit(f"{name}: nothing fits in {_format.fmt_bytes(cap)}")
    if choose is None:
        budgets = _budgets(args, fn, model, batch, top, cap)
    else:
        budgets = choose(top)
    results = []
    for b in budgets:
        if b != cap:  # planned already
            console.print(f"[bold]{name}[/]: budget {_format.fmt_bytes(b)}")
        results.append(top if b == cap else _plan(fn, model, batch, b, args.target))
    # In the order planned: later calls predict with more compiles behind them.
    calls = ([] if cap in budgets else [top]) + results
    plans = [r for r in calls if r is not None]
    row = {
        "group": name,
        "kind": "planning",
        "budgets": len(budgets),
        "calls": len(calls),
        "compiles": sum(r.compiles for r in plans),
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - cpu0,  # every thread's: XLA's too
        "load_average": (load0 + os.getloadavg()[0]) / 2,
    }
    console.print(
        f"[bold]{name}[/]: planned {len(budgets)} budgets in {row['seconds']:.0f} s "
        f"({row['cpu_seconds']:.0f} s of CPU, load average {row['load_average']:.1f}), "
        f"{row['compiles']} compiles"
    )
    return row, budgets, results, plans


def sweep_preset(args, name: str, preset: _models.Preset, console) -> list[dict]:
    """The rows of one preset: "planning", "uniform", "pick", "frontier" and,
    timed on the device, "timed" and "rounds" (several stacks:
    `sweep_stacks`)."""
    if len(preset.stack_depths()) > 1:
        return sweep_stacks(args, name, preset, console)
    specs = args.checkpoint or preset.checkpoints(
        quick=args.quick, accelerator=bool(args.target)
    )
    cands = [er.parse_checkpoint(s, preset.depth) for s in specs]
    mesh = _measure.mesh_for(args.target) if args.target else None
    model, batch = preset.build(abstract=True), preset.inputs(abstract=True)
    if mesh is not None:
        model = zoo.shard(model, mesh, fsdp=preset.fsdp)
        batch = _measure.place_batch(batch, mesh)
    fn = _step(preset, mesh)
    cap = _measure.V5E_HBM if args.target else 2**50
    # The flash kernel finds the mesh to shard_map over in the context.
    flash = mesh is not None and getattr(preset, "attention", None) == "flash"
    with jax.set_mesh(mesh) if flash else contextlib.nullcontext():
        planning, budgets, results, plans = _plan_budgets(
            args, name, fn, model, batch, cap, console
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
    leaves = _leaves(fn, model, batch)
    programs, memories = zip(
        *(_program(fn, model, batch, c, leaves) for c in predicted)
    )
    timings = er.internal.time_interleaved(programs, rounds=args.repeats)
    # Each checkpoint's time: its median ratio, round by round, to the fastest.
    fastest = min(range(len(timings)), key=lambda i: timings[i].seconds)
    timings = er.internal.on_one_clock(timings, fastest)
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
        for (c, p), t, memory in zip(predicted.items(), timings, memories)
    ]


def _leaves(fn, model, batch) -> list:
    """The arrays every program of `fn` runs on (made once, concrete)."""
    _, dynamic = er.internal.traceable(fn, (model, batch))
    return jax.tree.leaves(er.internal.concrete(dynamic))


def _program(fn, model, batch, c, leaves) -> tuple[Callable[[], Any], int]:
    """`fn` with `c` set on `model` (one checkpoint, or one per stack),
    compiled: one step on `leaves`, and its compiled memory (arguments,
    outputs and temporaries)."""
    f, dyn = er.internal.traceable(fn, (er.set_checkpoint(model, c), batch))
    exe = jax.jit(f).lower(dyn).compile()
    report = er.internal.compiled_report(exe, flops=0, target=jax.default_backend())
    inputs = jax.tree.unflatten(jax.tree.structure(dyn), leaves)
    return functools.partial(exe, inputs), report.total_bytes


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


def _timing(row: dict) -> er.internal.Timing:
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
        pick["clock_ratio"] = er.internal.paired_ratio(_timing(mine), _timing(best))
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
        "checkpoint": er.checkpoint_label(e.checkpoint),
        "memory_bytes": e.memory_bytes,
        "compiled": e.report is not None,
        **_entry(e, cap),
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
    point = next(
        (p for p in result.frontier if p.checkpoint == result.checkpoint), None
    )
    return row | {
        "checkpoint": er.checkpoint_label(result.checkpoint),
        "compiled_bytes": result.entry.memory_bytes,
        "predicted_bytes": None if point is None else point.predicted_bytes,
        **_entry(result.entry, budget),
        "compiles": result.compiles,
        "seconds": result.seconds,
        "notes": list(result.notes),
    }


# --------------------------------------------------------------------------------------
# Several stacks: the pick against every combination of uniform checkpoints.


def stacks_label(c: er.PerStack) -> str:
    """`nothing / dots`: each stack's checkpoint, in the order of the stacks
    (`stack_names`)."""
    return " / ".join(er.checkpoint_label(k) for k in c.values())


def stack_names(paths: Iterable[str]) -> str:
    """`encoder / decoder`: each stack by the name of the field that holds it
    (`.encoder.checkpoint`)."""
    return " / ".join(p.removesuffix(".checkpoint").lstrip(".") for p in paths)


def _per_stack(c: Any, paths: Sequence[str]) -> er.PerStack:
    """`c` as one checkpoint per stack, in the order of `paths`."""
    if isinstance(c, er.PerStack):
        return er.PerStack({p: c[p] for p in paths})
    return er.PerStack(dict.fromkeys(paths, c))


def sweep_stacks(args, name: str, preset: _models.Preset, console) -> list[dict]:
    """A preset of several stacks: every combination of one uniform candidate
    per stack compiled (a "combination" row each), the plan at each budget (a
    "pick" row each) and, on the device, every combination and pick timed in
    the same interleaved rounds."""
    depths = preset.stack_depths()
    specs = args.checkpoint or preset.checkpoints(quick=args.quick, accelerator=False)
    choices = [[er.parse_checkpoint(s, d) for s in specs] for d in depths.values()]
    combos = [er.PerStack(dict(zip(depths, cs))) for cs in itertools.product(*choices)]
    model, batch = preset.build(abstract=True), preset.inputs(abstract=True)
    fn = _step(preset, None)
    leaves = _leaves(fn, model, batch)
    console.print(
        f"[bold]{name}[/]: compiling {len(combos)} combinations of one uniform "
        f"checkpoint per stack ({len(specs)} per stack)"
    )
    programs = {c: _program(fn, model, batch, c, leaves) for c in combos}
    memory = {c: m for c, (_, m) in programs.items()}
    none = _per_stack(None, list(depths))
    if none not in memory:  # for the budgets only
        memory[none] = er.memory_report(
            fn, er.set_checkpoint(model, None), batch
        ).total_bytes
    planning, budgets, results, _ = _plan_budgets(
        args,
        name,
        fn,
        model,
        batch,
        2**50,
        console,
        choose=lambda top: _stack_budgets(args, top, memory, combos),
    )
    picks = [
        None if r is None else _per_stack(r.checkpoint, list(depths)) for r in results
    ]
    for c in dict.fromkeys(c for c in picks if c is not None and c not in programs):
        programs[c] = _program(fn, model, batch, c, leaves)
    timings: dict[er.PerStack, er.internal.Timing] = {}
    if args.clock:
        console.print(
            f"[bold]{name}[/]: timing {len(combos)} combinations and "
            f"{len(programs) - len(combos)} other picks, {args.repeats} "
            "interleaved rounds"
        )
        raw = er.internal.time_interleaved(
            [f for f, _ in programs.values()], rounds=args.repeats
        )
        fastest = min(range(len(raw)), key=lambda i: raw[i].seconds)
        timings = dict(zip(programs, er.internal.on_one_clock(raw, fastest)))
    rows = [planning]
    rows += [_combination_row(name, c, programs[c][1], timings.get(c)) for c in combos]
    rows += [
        _stack_pick_row(name, b, r, c, programs, timings, combos)
        for b, r, c in zip(budgets, results, picks)
    ]
    return rows


def _stack_budgets(args, top, memory: dict, combos: list) -> list[int]:
    """`--budgets` evenly spaced from the least compiled memory (of `top`'s
    frontier and of the combinations) to 1.1x every stack on `None`'s, and
    half-way between the memories of neighbouring combinations that put one
    checkpoint on every stack (where a checkpoint per stack can win)."""
    compiled = [p.compiled_bytes for p in top.frontier if p.compiled_bytes]
    low = min([*compiled, *(memory[c] for c in combos)])
    high = int(1.1 * max(memory.values()))
    if args.budgets == 1:
        budgets = [high]
    else:
        budgets = [int(round(b)) for b in np.linspace(low, high, args.budgets)]
    same = sorted({memory[c] for c in combos if _same(c)})
    pairs = zip(same, same[1:])
    return sorted(set(budgets) | {(lo + hi) // 2 for lo, hi in pairs if hi > 1.01 * lo})


def _same(c: er.PerStack) -> bool:
    """Whether `c` puts one checkpoint on every stack."""
    return len(set(c.values())) == 1


def _measured(t: er.internal.Timing | None) -> dict[str, Any]:
    if t is None:
        return {}
    return {"measured_s": t.seconds, "spread": t.spread, "times_s": list(t.times)}


def _combination_row(name, c, memory: int, t) -> dict[str, Any]:
    return {
        "group": name,
        "kind": "combination",
        "checkpoint": stacks_label(c),
        "checkpoints": {p: er.checkpoint_label(k) for p, k in c.items()},
        "same": _same(c),
        "memory_bytes": memory,
        **_measured(t),
    }


def _stack_pick_row(name, budget, result, c, programs, timings, combos) -> dict:
    """A budget's pick (`c`, of `result`), and by the clock beside the fastest
    fitting combination and the fastest fitting one that puts one checkpoint
    on every stack, both from the same rounds."""
    row: dict[str, Any] = {"group": name, "kind": "pick", "budget_bytes": budget}
    if result is None:
        return row | {"checkpoint": None, "fits": False}
    point = next(
        (p for p in result.frontier if p.checkpoint == result.checkpoint), None
    )
    row |= {
        "checkpoint": stacks_label(c),
        "checkpoints": {p: er.checkpoint_label(k) for p, k in c.items()},
        "compiled_bytes": result.entry.memory_bytes,
        "predicted_bytes": None if point is None else point.predicted_bytes,
        **_entry(result.entry, budget),
        "memory_bytes": programs[c][1],
        "compiles": result.compiles,
        "seconds": result.seconds,
        "notes": list(result.notes),
    }
    mine = timings.get(c)
    if mine is None:
        return row
    row |= {"measured_s": mine.seconds, "spread": mine.spread}
    fitting = [k for k in combos if programs[k][1] <= budget]
    for key, rivals in (
        ("combination", fitting),
        ("same", [k for k in fitting if _same(k)]),
    ):
        if not rivals:
            continue
        best = min(rivals, key=lambda k: timings[k].seconds)
        row[f"best_{key}"] = stacks_label(best)
        row[f"best_{key}_s"] = timings[best].seconds
        row[f"{key}_ratio"] = er.internal.paired_ratio(mine, timings[best])
    same = [
        {"memory_bytes": programs[k][1], "measured_s": timings[k].seconds}
        for k in combos
        if _same(k)
    ]
    row["same_between"] = _targets.between_same(same, budget)
    return row


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
        if r["group"] not in _stacked(rows):
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


def _stacked(rows: list[dict]) -> set[str]:
    """The presets of several stacks (those with "combination" rows)."""
    return {r["group"] for r in of_kind(rows, "combination")}


@dataclasses.dataclass(frozen=True)
class Pick:
    """One budget's pick (a row of kind "pick"), beside the best uniform
    candidate that fits (the fields the tables read)."""

    group: str
    budget_bytes: int
    checkpoint: str | None  # None: nothing fits
    best_uniform: str | None
    best_uniform_time_s: float | None
    compiled_bytes: int | None = None
    predicted_bytes: int | None = None
    time_s: float | None = None
    compiles: int | None = None
    # By the clock (where the device ran them).
    measured_s: float | None = None
    best_uniform_measured: str | None = None
    best_uniform_measured_s: float | None = None
    clock_ratio: float | None = None


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


@dataclasses.dataclass(frozen=True)
class StackPick:
    """Several stacks: one budget's pick (a row of kind "pick"), by the clock
    beside the fastest fitting combination of one uniform checkpoint per stack
    and the fastest fitting one that puts one checkpoint on every stack."""

    group: str
    budget_bytes: int
    checkpoint: str | None  # None: nothing fits
    compiled_bytes: int | None = None
    predicted_bytes: int | None = None
    time_s: float | None = None
    compiles: int | None = None
    # By the clock (where the device ran them).
    measured_s: float | None = None
    best_combination: str | None = None
    best_combination_s: float | None = None
    combination_ratio: float | None = None
    best_same: str | None = None
    best_same_s: float | None = None
    same_ratio: float | None = None
    same_between: bool = False


@dataclasses.dataclass(frozen=True)
class Combination:
    """Several stacks: one uniform checkpoint per stack, compiled and timed (a
    row of kind "combination")."""

    group: str
    checkpoint: str
    same: bool  # one checkpoint on every stack
    memory_bytes: int
    measured_s: float | None = None
    spread: float | None = None


C = _table.Column
ms, size = _format.fmt_ms, _format.fmt_bytes
PICKS: list[_table.Column[Pick]] = [
    C("preset", lambda r: r.group),
    C("budget", lambda r: size(r.budget_bytes)),
    C("pick", lambda r: r.checkpoint or "nothing fits", code=True),
    C("compiled", lambda r: size(r.compiled_bytes)),
    C("predicted", lambda r: size(r.predicted_bytes)),
    C("est. time", lambda r: ms(r.time_s)),
    C("best uniform that fits", lambda r: r.best_uniform or "-", code=True),
    C("its est. time", lambda r: ms(r.best_uniform_time_s)),
    C("compiles", lambda r: "n/a" if r.compiles is None else str(r.compiles)),
]
"""Each budget's pick, on the console and in report.py."""
CLOCK: list[_table.Column[Pick]] = [
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
STACK_PICKS: list[_table.Column[StackPick]] = [
    C("preset", lambda r: r.group),
    C("budget", lambda r: size(r.budget_bytes)),
    C("pick", lambda r: r.checkpoint or "nothing fits", code=True),
    C("compiled", lambda r: size(r.compiled_bytes)),
    C("predicted", lambda r: size(r.predicted_bytes)),
    C("est. time", lambda r: ms(r.time_s)),
    C("compiles", lambda r: "n/a" if r.compiles is None else str(r.compiles)),
]
"""Several stacks: each budget's pick, as the planner says."""


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}x"


STACK_CLOCK: list[_table.Column[StackPick]] = [
    C("budget", lambda r: size(r.budget_bytes)),
    C("pick, measured", lambda r: ms(r.measured_s)),
    C("fastest fitting combination", lambda r: r.best_combination or "-", code=True),
    C("pick / it", lambda r: _ratio(r.combination_ratio)),
    C("fastest fitting, one on every stack", lambda r: r.best_same or "-", code=True),
    C("pick / that", lambda r: _ratio(r.same_ratio)),
    C("between its points", lambda r: "yes" if r.same_between else ""),
]
"""Several stacks: each pick by the clock (the budgets of the table of picks,
in its order), beside the fastest fitting combination and the fastest
fitting one that puts one checkpoint on every stack."""
COMBINATIONS: list[_table.Column[Combination]] = [
    C("preset", lambda r: r.group),
    C("checkpoint per stack", lambda r: r.checkpoint, code=True),
    C("one everywhere", lambda r: "yes" if r.same else ""),
    C("memory", lambda r: size(r.memory_bytes)),
    C("measured", lambda r: ms(r.measured_s)),
    C("spread", lambda r: _format.fmt_pct(r.spread)),
]
"""Several stacks: every combination of one uniform checkpoint per stack."""
TIMED_NOTE = (
    "predicted: the planner's time (* estimated: a mix from its options' "
    "measured times per layer); roofline: FLOPs at peak + bytes moved at "
    "bandwidth, the device's figures (a CPU's by calibration); spread: "
    "interquartile range / median"
)


def tables(data: dict) -> dict[str, tuple[list[_table.Column], list]]:
    """The sweep's tables, on the console and in report.py: title -> (its
    columns, its rows)."""
    rows, stacked = data["rows"], _stacked(data["rows"])
    mine = [r for r in of_kind(rows, "pick") if r["group"] not in stacked]
    picks = _table.read_all(Pick, mine)
    timed = _table.read_all(Timed, of_kind(rows, "timed"))
    timed.sort(key=lambda r: (r.group, r.memory_bytes))
    out = {"Picks": (PICKS, picks)} if picks or not stacked else {}
    if timed:
        clocked = [r for r in picks if r.best_uniform_measured_s]
        out["By the clock (every pick and uniform checkpoint timed afresh, "
            "round-robin)"] = (CLOCK, clocked)  # fmt: skip
        out["Timed afresh: predicted against measured"] = (TIMED, timed)
    if stacked:
        out |= _stack_tables(rows, stacked)
    return out


def _stack_tables(rows: list[dict], stacked: set[str]) -> dict[str, tuple]:
    """The tables of the presets of several stacks."""
    picks = [r for r in of_kind(rows, "pick") if r["group"] in stacked]
    picks = _table.read_all(StackPick, picks)
    combos = _table.read_all(Combination, of_kind(rows, "combination"))
    combos.sort(key=lambda r: (r.group, r.memory_bytes))
    names = [stack_names(r["checkpoints"]) for r in of_kind(rows, "combination")]
    order = "; ".join(dict.fromkeys(names))  # the stacks, in their checkpoints' order
    out = {f"Several stacks: each budget's pick ({order})": (STACK_PICKS, picks)}
    clocked = [r for r in picks if r.best_combination_s]
    if clocked:
        title = (
            "Several stacks by the clock: each pick beside every combination of "
            "one uniform checkpoint per stack, timed in the same rounds"
        )
        out[title] = (STACK_CLOCK, clocked)
    title = (
        "Several stacks: every combination of one uniform checkpoint per stack "
        f"({order})"
    )
    out[title] = (COMBINATIONS, combos)
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
    stacked = _stacked(data["rows"])
    n = 2 if clock else 1
    size = (7 * len(groups), 4.6 * n)
    fig, axes = _plots.plt().subplots(n, len(groups), figsize=size, squeeze=False)
    points = []
    for i, g in enumerate(groups):
        rows = [r for r in data["rows"] if r["group"] == g]
        p = data["presets"][g]
        title = textwrap.fill(f"{g}: {p['describe']} [{p['topology']}]", 95)
        draw = _plot_stacks if g in stacked else _plot_preset
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


def _budget_lines(ax, budgets: list[int], size: float) -> None:
    """Each budget a dotted vertical line (in units of `size` bytes)."""
    for b in budgets:
        ax.axvline(b / size, color="0.6", lw=0.8, ls=":", zorder=0)


def _picks(ax, xs: list, ys: list, label: str, title: str, **labels: str) -> None:
    """The picks starred, the budgets' line in the legend, and the panel's
    title, axis labels, grid and legend."""
    ax.scatter(xs, ys, marker="*", s=110, color="tab:red", label=label, zorder=4)
    ax.plot([], [], color="0.6", lw=0.8, ls=":", label="budgets")
    _finish(ax, title, **labels)


def _finish(ax, title: str, **labels: str) -> None:
    ax.set(title=title, **labels)
    ax.title.set_fontsize(8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _plot_preset(ax, rows: list[dict], title: str) -> tuple[list, list]:
    """Uniform candidates grey, the frontier a line, the budgets dotted, the
    picks starred. Returns `[labelled, others]` for `_plots.label_points`: the
    uniform candidates, and the frontier's and the picks' points."""
    uniform = [r for r in of_kind(rows, "uniform") if r["compiled"]]
    frontier = of_kind(rows, "frontier")
    picks = [r for r in of_kind(rows, "pick") if r["checkpoint"]]
    budgets = [r["budget_bytes"] for r in of_kind(rows, "pick")]
    memories = [r["memory_bytes"] for r in uniform + frontier] + budgets
    unit, size = _plots.byte_unit(memories)
    _budget_lines(ax, budgets, size)
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
    _picks(
        ax,
        xs,
        ys,
        "pick at each budget (compiled)",
        title,
        xlabel=f"device memory per chip ({unit}): args + outputs + temporaries",
        ylabel="step time (ms): measured, or estimated",
    )
    return labelled, others + list(zip(xs, ys))


def _plot_stacks(ax, rows: list[dict], title: str) -> tuple[list, list]:
    """Several stacks: every combination of one uniform checkpoint per stack
    (grey; one checkpoint on every stack blue, labelled), the budgets dotted,
    the picks starred, memory against measured step time. Returns
    `[labelled, others]` for `_plots.label_points`."""
    combos = [r for r in of_kind(rows, "combination") if r.get("measured_s")]
    picks = [r for r in of_kind(rows, "pick") if r.get("measured_s")]
    budgets = [r["budget_bytes"] for r in of_kind(rows, "pick")]
    unit, size = _plots.byte_unit([r["memory_bytes"] for r in combos] + budgets)
    _budget_lines(ax, budgets, size)
    others: list[tuple[float, float]] = []
    labelled = []
    for same, color, s, label in (
        (False, "0.6", 22, "a uniform checkpoint per stack"),
        (True, "tab:blue", 36, "one checkpoint on every stack"),
    ):
        mine = [r for r in combos if r["same"] == same]
        xs = [r["memory_bytes"] / size for r in mine]
        ys = [1e3 * r["measured_s"] for r in mine]
        ax.scatter(xs, ys, color=color, s=s, label=label, zorder=2 + same)
        if same:
            names = [next(iter(r["checkpoints"].values())) for r in mine]
            labelled = list(zip(xs, ys, names))
        else:
            others += list(zip(xs, ys))
    xs = [r["memory_bytes"] / size for r in picks]
    ys = [1e3 * r["measured_s"] for r in picks]
    _picks(
        ax,
        xs,
        ys,
        "pick at each budget (compiled, timed)",
        title,
        xlabel=f"device memory ({unit}): args + outputs + temporaries",
        ylabel="step time (ms): median of interleaved rounds",
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
    _finish(
        ax,
        f"{group}: predicted against measured "
        f"(Spearman: {'n/a' if rho is None else f'{rho:.2f}'})",
        xlabel="measured step time (ms), median of interleaved rounds",
        ylabel="predicted step time (ms)",
    )


if __name__ == "__main__":
    main()

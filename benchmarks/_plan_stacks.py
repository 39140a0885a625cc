"""`plan_sweep.py`'s experiment on a preset of several stacks
(`encoder-decoder`): the plan at each budget against every combination of one
uniform checkpoint per stack, each pick timed beside them in the same
interleaved rounds. Its rows ("combination", and "pick" read as
`_planner.Pick`), its tables and its panel.
"""

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

import eqx_remat as er

from . import _format, _models, _planner, _plots, _table, _targets, _timing
from ._results import of_kind


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


def sweep(args, name: str, preset: _models.Preset, console) -> list[dict]:
    """A preset of several stacks: every combination of one uniform candidate
    per stack compiled (a "combination" row each), the plan at each budget (a
    "pick" row each) and, on the device, every combination and pick timed in
    the same interleaved rounds."""
    depths = preset.stack_depths()
    specs = args.checkpoint or preset.checkpoints(quick=args.quick, accelerator=False)
    choices = [[er.parse_checkpoint(s, d) for s in specs] for d in depths.values()]
    combos = [er.PerStack(dict(zip(depths, cs))) for cs in itertools.product(*choices)]
    model, batch = preset.build(abstract=True), preset.inputs(abstract=True)
    fn = _planner.step_fn(preset, None)
    leaves = _timing.input_leaves(model, batch)

    def compiled(c: er.PerStack) -> _timing.Step:
        return _timing.compile_step(
            fn, er.set_checkpoint(model, c), batch, leaves=leaves
        )

    console.print(
        f"[bold]{name}[/]: compiling {len(combos)} combinations of one uniform "
        f"checkpoint per stack ({len(specs)} per stack)"
    )
    steps = {c: compiled(c) for c in combos}
    memory = {c: s.memory_bytes for c, s in steps.items()}
    none = _per_stack(None, list(depths))
    if none not in memory:  # for the budgets only
        memory[none] = er.memory_report(
            fn, er.set_checkpoint(model, None), batch
        ).total_bytes
    planning, budgets, results, _ = _planner.plan_budgets(
        args,
        name,
        fn,
        model,
        batch,
        2**50,
        console,
        choose=lambda top: _budgets(args, top, memory, combos),
    )
    picks = [
        None if r is None else _per_stack(r.checkpoint, list(depths)) for r in results
    ]
    for c in dict.fromkeys(c for c in picks if c is not None and c not in steps):
        steps[c] = compiled(c)
        memory[c] = steps[c].memory_bytes
    timings: dict[er.PerStack, er.internal.Timing] = {}
    if args.clock:
        console.print(
            f"[bold]{name}[/]: timing {len(combos)} combinations and "
            f"{len(steps) - len(combos)} other picks, {args.repeats} "
            "interleaved rounds"
        )
        got = _timing.time_steps(list(steps.values()), args.repeats, on="fastest")
        timings = dict(zip(steps, got))
    rows = [planning]
    rows += [_combination_row(name, c, memory[c], timings.get(c)) for c in combos]
    rows += [
        _pick_row(name, b, r, c, memory, timings, combos)
        for b, r, c in zip(budgets, results, picks)
    ]
    return rows


def _budgets(args, top, memory: dict, combos: list) -> list[int]:
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


def _pick_row(name, budget, result, c, memory, timings, combos) -> dict:
    """A budget's pick (`c`, of `result`), and by the clock beside the fastest
    fitting combination and the fastest fitting one that puts one checkpoint
    on every stack, both from the same rounds."""
    row: dict[str, Any] = {"group": name, "kind": "pick", "budget_bytes": budget}
    if result is None:
        return row | {"checkpoint": None, "fits": False}
    row |= {
        "checkpoint": stacks_label(c),
        "checkpoints": {p: er.checkpoint_label(k) for p, k in c.items()},
        **_planner.pick_fields(result, budget, memory_bytes=memory[c]),
    }
    mine = timings.get(c)
    if mine is None:
        return row
    row |= {"measured_s": mine.seconds, "spread": mine.spread}
    fitting = [k for k in combos if memory[k] <= budget]
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
        {"memory_bytes": memory[k], "measured_s": timings[k].seconds}
        for k in combos
        if _same(k)
    ]
    row["same_between"] = _targets.between_same(same, budget)
    return row


def groups(rows: list[dict]) -> set[str]:
    """The presets of several stacks (those with "combination" rows)."""
    return {r["group"] for r in of_kind(rows, "combination")}


@dataclasses.dataclass(frozen=True)
class Combination:
    """One uniform checkpoint per stack, compiled and timed (a row of kind
    "combination")."""

    group: str
    checkpoint: str
    same: bool  # one checkpoint on every stack
    memory_bytes: int
    measured_s: float | None = None
    spread: float | None = None


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}x"


C = _table.Column
ms, size = _format.fmt_ms, _format.fmt_bytes
PICKS: list[_table.Column[_planner.Pick]] = [*_planner.PLANNED, _planner.COMPILES]
"""Each budget's pick, as the planner says."""
CLOCK: list[_table.Column[_planner.Pick]] = [
    C("budget", lambda r: size(r.budget_bytes)),
    C("pick, measured", lambda r: ms(r.measured_s)),
    C("fastest fitting combination", lambda r: r.best_combination or "-", code=True),
    C("pick / it", lambda r: _ratio(r.combination_ratio)),
    C("fastest fitting, one on every stack", lambda r: r.best_same or "-", code=True),
    C("pick / that", lambda r: _ratio(r.same_ratio)),
    C("between its points", lambda r: "yes" if r.same_between else ""),
]
"""Each pick by the clock (the budgets of the table of picks, in its order),
beside the fastest fitting combination and the fastest fitting one that puts
one checkpoint on every stack."""
COMBINATIONS: list[_table.Column[Combination]] = [
    C("preset", lambda r: r.group),
    C("checkpoint per stack", lambda r: r.checkpoint, code=True),
    C("one everywhere", lambda r: "yes" if r.same else ""),
    C("memory", lambda r: size(r.memory_bytes)),
    C("measured", lambda r: ms(r.measured_s)),
    C("spread", lambda r: _format.fmt_pct(r.spread)),
]
"""Every combination of one uniform checkpoint per stack."""


def tables(rows: list[dict], stacked: set[str]) -> dict[str, tuple]:
    """The tables of the presets of several stacks (`stacked`): title -> (its
    columns, its rows)."""
    picks = [r for r in of_kind(rows, "pick") if r["group"] in stacked]
    picks = _table.read_all(_planner.Pick, picks)
    combos = _table.read_all(Combination, of_kind(rows, "combination"))
    combos.sort(key=lambda r: (r.group, r.memory_bytes))
    names = [stack_names(r["checkpoints"]) for r in of_kind(rows, "combination")]
    order = "; ".join(dict.fromkeys(names))  # the stacks, in their checkpoints' order
    out = {f"Several stacks: each budget's pick ({order})": (PICKS, picks)}
    clocked = [r for r in picks if r.best_combination_s]
    if clocked:
        title = (
            "Several stacks by the clock: each pick beside every combination of "
            "one uniform checkpoint per stack, timed in the same rounds"
        )
        out[title] = (CLOCK, clocked)
    title = (
        "Several stacks: every combination of one uniform checkpoint per stack "
        f"({order})"
    )
    out[title] = (COMBINATIONS, combos)
    return out


def panel(ax, rows: list[dict], title: str) -> tuple[list, list]:
    """Every combination of one uniform checkpoint per stack (grey; one
    checkpoint on every stack blue, labelled), the budgets dotted, the picks
    starred, memory against measured step time. Returns `[labelled, others]`
    for `_plots.label_points`."""
    combos = [r for r in of_kind(rows, "combination") if r.get("measured_s")]
    picks = [r for r in of_kind(rows, "pick") if r.get("measured_s")]
    budgets = [r["budget_bytes"] for r in of_kind(rows, "pick")]
    unit, size = _plots.byte_unit([r["memory_bytes"] for r in combos] + budgets)
    _planner.budget_lines(ax, budgets, size)
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
    _planner.picks(
        ax,
        xs,
        ys,
        "pick at each budget (compiled, timed)",
        title,
        xlabel=f"device memory ({unit}): args + outputs + temporaries",
        ylabel="step time (ms): median of interleaved rounds",
    )
    return labelled, others + list(zip(xs, ys))

"""What the planner sweeps share (`plan_sweep.py`: one stack there, several
stacks in `_plan_stacks.py`): the function planned, the plans at a list of
budgets (the "planning" row), a pick's row (`Pick`, the one row type of a pick,
one stack or several) and its columns, and the parts of a pick panel.
"""

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx

import eqx_remat as er
import zoo

from . import _format, _models, _table


def step_fn(preset: _models.Preset, mesh: Any) -> Callable:
    """The function planned: the gradient of the preset's loss (under FSDP kept
    sharded like the parameters)."""
    grad = eqx.filter_grad(preset.loss)
    if mesh is None or not preset.fsdp:
        return grad
    return lambda model, batch: zoo.shard(grad(model, batch), mesh, fsdp=True)


def plan_or_none(fn, model, batch, budget: int, target) -> er.PlanResult | None:
    """The planner's answer, or `None` where nothing fits the budget."""
    try:
        return er.plan(fn, model, batch, budget_bytes=budget, target=target)
    except ValueError as e:
        if "fits" not in str(e):
            raise
        return None


def plan_budgets(args, name, fn, model, batch, cap: int, console, choose: Callable):
    """Plan at `cap`, then at each budget (`choose(top)`, the plan at `cap`
    given) with the same function object (the planner reuses its
    compilations): the "planning" row, the budgets, each one's plan (`None`:
    nothing fits) and every plan made, in order."""
    load0, t0, cpu0 = os.getloadavg()[0], time.perf_counter(), time.process_time()
    console.print(f"[bold]{name}[/]: planning at {_format.fmt_bytes(cap)} first")
    top = plan_or_none(fn, model, batch, cap, args.target)
    if top is None:
        raise SystemExit(f"{name}: nothing fits in {_format.fmt_bytes(cap)}")
    budgets = choose(top)
    results = []
    for b in budgets:
        if b != cap:  # planned already
            console.print(f"[bold]{name}[/]: budget {_format.fmt_bytes(b)}")
        results.append(
            top if b == cap else plan_or_none(fn, model, batch, b, args.target)
        )
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


def entry_fields(e: er.PlanEntry, budget: int) -> dict[str, Any]:
    """A plan's entry: whether it fits `budget` when compiled, its cost."""
    compiled = e.report is not None
    return {
        "fits": compiled and e.memory_bytes <= budget,
        "flops": e.flops,
        "host_bytes": e.report.host_temp_bytes if compiled else 0,
        "time_s": e.time_s,
    }


def pick_fields(result: er.PlanResult, budget: int, **measured: Any) -> dict[str, Any]:
    """A pick row's fields from the plan at `budget` (`result`, which fits):
    its compiled and predicted memory, its entry (`entry_fields`), then
    `measured` (what the experiment compiled itself), then what planning it
    cost."""
    point = next(
        (p for p in result.frontier if p.checkpoint == result.checkpoint), None
    )
    return {
        "compiled_bytes": result.entry.memory_bytes,
        "predicted_bytes": None if point is None else point.predicted_bytes,
        **entry_fields(result.entry, budget),
        **measured,
        "compiles": result.compiles,
        "seconds": result.seconds,
        "notes": list(result.notes),
    }


@dataclasses.dataclass(frozen=True)
class Pick:
    """One budget's pick (a row of kind "pick"), of one stack or several, as
    the planner says and, where the device ran it, by the clock beside its
    rivals: one stack's beside the best uniform candidate that fits, several
    stacks' beside the fastest fitting combination of one uniform checkpoint
    per stack and the fastest fitting one that puts one checkpoint on every
    stack (the fields the tables read)."""

    group: str
    budget_bytes: int
    checkpoint: str | None  # None: nothing fits
    compiled_bytes: int | None = None
    predicted_bytes: int | None = None
    time_s: float | None = None
    compiles: int | None = None
    measured_s: float | None = None  # by the clock
    # One stack: the best uniform candidate that fits, estimated and measured.
    best_uniform: str | None = None
    best_uniform_time_s: float | None = None
    best_uniform_measured: str | None = None
    best_uniform_measured_s: float | None = None
    clock_ratio: float | None = None
    # Several stacks, by the clock.
    best_combination: str | None = None
    best_combination_s: float | None = None
    combination_ratio: float | None = None
    best_same: str | None = None
    best_same_s: float | None = None
    same_ratio: float | None = None
    same_between: bool = False


C = _table.Column
ms, size = _format.fmt_ms, _format.fmt_bytes
PLANNED: list[_table.Column[Pick]] = [
    C("preset", lambda r: r.group),
    C("budget", lambda r: size(r.budget_bytes)),
    C("pick", lambda r: r.checkpoint or "nothing fits", code=True),
    C("compiled", lambda r: size(r.compiled_bytes)),
    C("predicted", lambda r: size(r.predicted_bytes)),
    C("est. time", lambda r: ms(r.time_s)),
]
"""A pick as the planner says, the first columns of every table of picks."""
COMPILES = C("compiles", lambda r: "n/a" if r.compiles is None else str(r.compiles))
"""What the pick's plan compiled, the last column of every table of picks."""


# --------------------------------------------------------------------------------------
# A pick panel: memory against step time, the budgets dotted, the picks starred.


def budget_lines(ax, budgets: list[int], size: float) -> None:
    """Each budget a dotted vertical line (in units of `size` bytes)."""
    for b in budgets:
        ax.axvline(b / size, color="0.6", lw=0.8, ls=":", zorder=0)


def picks(ax, xs: list, ys: list, label: str, title: str, **labels: str) -> None:
    """The picks starred, the budgets' line in the legend, and the panel's
    title, axis labels, grid and legend."""
    ax.scatter(xs, ys, marker="*", s=110, color="tab:red", label=label, zorder=4)
    ax.plot([], [], color="0.6", lw=0.8, ls=":", label="budgets")
    finish(ax, title, **labels)


def finish(ax, title: str, **labels: str) -> None:
    """The panel's title, axis labels, grid and legend."""
    ax.set(title=title, **labels)
    ax.title.set_fontsize(8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)

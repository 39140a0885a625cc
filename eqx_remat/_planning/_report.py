"""What `eqx_remat.plan` returns: `PlanResult`, its entries, frontier points and
batch options, how they print, the error when nothing fits, and the progress
lines (`Progress`)."""

import dataclasses
import math
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

from .._accumulate import accumulate
from .._inspect._compiled import Compiled
from .._inspect._memory import MemoryReport
from .._schedules._checkpoint import (
    Checkpoint,
    PerStack,
    Planned,
    checkpoint_name,
    map_loss_chunk_sizes,
    set_checkpoint,
)
from .._schedules._ranges import ranges
from .._util import format_bytes, format_flops, format_size, format_time


class PlanEntry(NamedTuple):
    """One compiled checkpoint: a row of a [`eqx_remat.PlanResult`][]'s `table`
    (the candidates given to [`eqx_remat.plan`][]) or its `entry` (the pick).

    **Attributes:**

    - `checkpoint`: the candidate (a policy name, policy or schedule, or `None`).
    - `memory_bytes`: device memory it needs: arguments + outputs + temporaries
      of the compiled function (per chip on a TPU target). Host memory that
      offloading uses is not counted. For a candidate that XLA refused to
      compile because it does not fit in one device (`RESOURCE_EXHAUSTED`),
      XLA's own figure of what it needed (its temporaries: a lower bound), or
      `None` where XLA's message gives none.
    - `flops`: FLOPs of the function, loop trip counts and recomputation
      included: [`eqx_remat.count_flops`][], exact for every schedule.
    - `fits`: whether `memory_bytes <= budget_bytes` (always `False` for a
      candidate XLA refused to compile), against the budget the plan ended
      with.
    - `report`: the full [`eqx_remat.MemoryReport`][], or `None` for a candidate
      XLA refused to compile.
    - `error`: XLA's message for a candidate it refused to compile, else `None`.
    - `time_s`: its step time: measured on the device at hand (`measured`),
      else the roofline's estimate (see
      [How the planner solves][how-the-planner-solves]).
    - `measured`: whether `time_s` was measured by running it.
    """

    checkpoint: Planned
    memory_bytes: int | None
    flops: int
    fits: bool
    report: MemoryReport | None
    error: str | None = None
    time_s: float = 0.0
    measured: bool = False


class FrontierPoint(NamedTuple):
    """One point of the Pareto frontier of a [`eqx_remat.PlanResult`][]: no
    other point found needs less memory and less time.

    **Attributes:**

    - `checkpoint`: the checkpoint (a uniform option, a schedule, or a
      `eqx_remat.ranges` mix of two options).
    - `predicted_bytes`: device memory per chip that the planner's model
      predicts (arguments + outputs + temporaries, as `memory_bytes`).
    - `compiled_bytes`: what compiling it gave, or `None` where it was not
      compiled.
    - `flops`: the function's FLOPs under it (exact for uniform options,
      schedules and compiled mixes, [`eqx_remat.count_flops`][]; summed per
      layer for another mix).
    - `host_bytes`: bytes per chip it offloads to host memory.
    - `time_s`: its step time on one chip: measured, or estimated (a mix from
      its two options' times per layer; else the roofline).
    - `measured`: whether `time_s` was measured by running it.
    """

    checkpoint: Planned
    predicted_bytes: int
    compiled_bytes: int | None
    flops: int
    host_bytes: int
    time_s: float
    measured: bool = False


class BatchOption(NamedTuple):
    """One way to run the global batch that [`eqx_remat.plan`][] compared when
    given `micro_batches=` or `loss_chunks=`: a row of a
    [`eqx_remat.PlanResult`][]'s `batches`.

    **Attributes:**

    - `micro_batches`: how many micro-batches the batch is split into
      ([`eqx_remat.accumulate`][]).
    - `loss_chunk_size`: the `loss_chunk_size` of the model's loss head
      (`None`: whole logits; see `zoo.cross_entropy`).
    - `checkpoint`: the fastest checkpoint found that fits, this way.
    - `memory_bytes`: its compiled memory (the whole global batch's step).
    - `time_s`: its time per global batch: measured, or the roofline's (on
      a mesh, plus its collectives').
    - `measured`: whether `time_s` was measured by running it.
    - `mesh`: planned with `shard=`, the mesh (axes `("data", "fsdp")`);
      else `None`.
    """

    micro_batches: int
    loss_chunk_size: int | None
    checkpoint: Planned
    memory_bytes: int
    time_s: float
    measured: bool
    mesh: Any = None


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """What [`eqx_remat.plan`][] found.

    **Attributes:**

    - `checkpoint`: the pick: the least step time among what fits the budget.
    - `entry`: its [`eqx_remat.PlanEntry`][] (it is always compiled).
    - `table`: with `candidates=`, every candidate's entry in the order given;
      else `()`.
    - `budget_bytes`: the budget, in bytes (less than asked where the device
      holds less: `notes` says so).
    - `target`: what was compiled for (`"cpu"`, `"gpu"`, `"v5e:2x2"`, ...).
    - `frontier`: the Pareto frontier of memory and step time that the
      planner found, least memory first, as [`eqx_remat.FrontierPoint`][]s
      (`()` with `candidates=`).
    - `notes`: what the planner wants you to know: stacks it could not mix,
      picks that did not fit when compiled or ran slower than a uniform
      option, and what it did instead.
    - `compiles`: how many functions it compiled (compilations cached from an
      earlier call are not counted).
    - `seconds`: how long it took.
    - `timed_seconds`: how much of it was spent running programs to time them.
    - `micro_batches`: how many micro-batches to split the batch into (1
      unless planned with `micro_batches=`): `step` applies it.
    - `loss_chunk_size`: the loss head's chunking the plan ran with (planned
      with `loss_chunks=`, else the model's own; `None` where the model has
      none): `apply` sets it where it was planned.
    - `in_axes`: the batch axes `plan` was given, for `step`.
    - `estimate`: how a time not measured was estimated: the roofline (then
      the collectives, where the chips send each other anything), and, on a
      chip whose published runs were compared with it, the fraction of the
      roofline's rate they reach (`"roofline; MaxText's measured v5e runs
      reach 0.79 of it"`): printed beside the estimates.
    - `batches`: planned with `micro_batches=` or `loss_chunks=`, the best
      found for each (micro-batches, loss chunking) combination that fits, as
      [`eqx_remat.BatchOption`][]s, fastest first; else `()`. `frontier` is
      that of the combination solved in full (see
      [Which combination][which-combination]).
    - `mesh`: planned with `shard=`, the mesh chosen (a `jax.sharding.Mesh`
      with axes `("data", "fsdp")`): `shard(result.mesh)` places the step
      and its arguments on it; else `None`.
    - `stacks`: the path of the `checkpoint` field of each stack `fn`
      differentiates, in the order it runs them, as
      [`eqx_remat.set_checkpoint`][] takes them and a
      [`eqx_remat.PerStack`][] pick is keyed: from inside the argument that
      holds them (`".encoder.checkpoint"`), or from the arguments
      (`"[1].checkpoint"`) where the stacks are in several.
    """

    checkpoint: Planned
    entry: PlanEntry
    table: tuple[PlanEntry, ...]
    budget_bytes: int
    target: str
    frontier: tuple[FrontierPoint, ...] = ()
    notes: tuple[str, ...] = ()
    compiles: int = 0
    seconds: float = 0.0
    timed_seconds: float = 0.0
    micro_batches: int = 1
    loss_chunk_size: int | None = None
    in_axes: Any = (None, 0)
    batches: tuple[BatchOption, ...] = ()
    estimate: str = "roofline"
    stacks: tuple[str, ...] = ()
    mesh: Any = None

    def apply(self, tree: Any) -> Any:
        """`eqx_remat.set_checkpoint(tree, self.checkpoint)`: a copy of `tree`
        (e.g. the model) using the chosen checkpoint; planned with
        `loss_chunks=`, with `loss_chunk_size` set too
        (`zoo.set_loss_chunk_size`).

        To switch a model being trained, give it with its optimiser state:
        `model, opt_state = result.apply((model, opt_state))` sets the copies
        of the model's modules in the state (Adam's `mu` and `nu`) too, so
        the next `optimiser.update` sees matching structures."""
        tree = set_checkpoint(tree, self.checkpoint)
        if self.batches and map_loss_chunk_sizes(tree, lambda c: c)[1]:
            tree = map_loss_chunk_sizes(tree, lambda _: self.loss_chunk_size)[0]
        return tree

    def step(self, grad_fn: Callable[..., Any]) -> Callable[..., Any]:
        """`grad_fn` run over `micro_batches` micro-batches:
        `eqx_remat.accumulate(grad_fn, self.micro_batches, in_axes=self.in_axes)`
        (the gradient function the plan was made for, or one like it)."""
        return accumulate(grad_fn, self.micro_batches, in_axes=self.in_axes)

    def __str__(self) -> str:
        checkpoints = [self.checkpoint, *(p.checkpoint for p in self.frontier)]
        checkpoints += [b.checkpoint for b in self.batches]
        checkpoints += [e.checkpoint for e in self.table]
        return _fit(checkpoints, self._render)

    def _render(self, names: "_Names") -> str:
        e = self.entry
        batch = ""
        if self.batches:
            batch = (
                f", micro_batches={self.micro_batches}, "
                f"loss_chunk_size={self.loss_chunk_size}"
            )
        if self.mesh is not None:
            batch += f", mesh={mesh_name(self.mesh)}"
        lines = [
            f"plan for a budget of {format_bytes(self.budget_bytes)} "
            f"[{self.target}]: checkpoint={names.short(self.checkpoint)}{batch}"
        ]
        how = "measured" if e.measured else "estimated"
        lines.append(
            f"  {format_bytes(e.memory_bytes or 0)} compiled, "
            f"{format_flops(e.flops)} FLOPs, {format_time(e.time_s)} per step "
            f"({how})"
        )
        lines += [_wrap(f"note: {n}", "  ", "    ") for n in self.notes]
        if self.batches:
            lines += ["batches (per global batch):", _batch_table(self, names)]
        if self.frontier:
            frontier = _frontier_table(self.frontier, self.checkpoint, names)
            lines += ["frontier:", frontier]
        if self.table:
            lines.append(_table(self.table, self.entry, names))
        estimated = not e.measured or any(
            not p.measured for p in (*self.frontier, *self.table, *self.batches)
        )
        if estimated:
            lines.append(_wrap(f"estimated: {self.estimate}", "", "  "))
        legend = names.legend()
        if legend:
            lines += ["where:"] + [_wrap(line, "  ", "    ") for line in legend]
        return "\n".join(lines)


class Progress:
    """Lines on stderr (`plan: ...`): the stages (`progress=True`), or every
    step too (`"verbose"`)."""

    def __init__(self, level: bool | str):
        self.level = 2 if level == "verbose" else int(bool(level))
        self.start = time.perf_counter()

    def __call__(self, message: str, *, detail: bool = False) -> None:
        if self.level > int(detail):
            print(f"plan: {message}", file=sys.stderr, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class NothingFits(ValueError):
    """No candidate fits the budget (a `ValueError`, as `plan` documents)."""


def raise_nothing_fits(
    table: Sequence[PlanEntry], budget: int, target: str
) -> NoReturn:
    def render(names: _Names) -> str:
        legend = [_wrap(line, "", "    ") for line in names.legend()]
        return "\n".join([_table(table, None, names), *legend])

    head = f"No candidate fits in budget_bytes={format_bytes(budget)} [{target}]"
    measured = [e for e in table if e.report is not None]
    if not measured:
        why = (
            ": XLA refused to compile every one of them (RESOURCE_EXHAUSTED: "
            "larger than one device's memory)."
        )
    else:
        best = min(measured, key=lambda e: e.memory_bytes or 0)
        least = best.memory_bytes or 0  # compiled: never None
        why = (
            f". Of the checkpoints compiled, the least memory is "
            f"{format_bytes(least)} ({least} bytes), with "
            f"checkpoint={checkpoint_name(best.checkpoint)}."
        )
    raise NothingFits(head + why + "\n" + _fit([e.checkpoint for e in table], render))


_COLUMNS = 100


class _Names:
    """Checkpoint names for tables: in full, or, for those longer than
    `longest` characters, short aliases (`P1`, `P2`, ...) with a legend; a
    `ranges` mix is named by its parts."""

    def __init__(self, checkpoints: Sequence[Planned], longest: float | int):
        self.alias: dict[Checkpoint, str] = {}
        for c in checkpoints:
            for p in _parts(c):
                if len(checkpoint_name(p)) > longest and p not in self.alias:
                    self.alias[p] = f"P{len(self.alias) + 1}"

    def short(self, c: Planned) -> str:
        if isinstance(c, PerStack):
            inner = ", ".join(f"{p!r}: {self.short(k)}" for p, k in c.items())
            return f"{{{inner}}}"
        if isinstance(c, ranges):
            inner = ", ".join(f"({n}, {self.short(p)})" for n, p in c.parts)
            return f"ranges({inner})"
        return self.alias.get(c, checkpoint_name(c))

    def legend(self) -> list[str]:
        return [f"{a} = {checkpoint_name(c)}" for c, a in self.alias.items()]


def _parts(c: Planned) -> list[Checkpoint]:
    """The checkpoints `c` is made of: a mix's parts, each stack's."""
    if isinstance(c, PerStack):
        return [p for k in c.values() for p in _parts(k)]
    return [p for _, p in c.parts] if isinstance(c, ranges) else [c]


def _fit(checkpoints: Sequence[Planned], render: Callable[[_Names], str]) -> str:
    """`render(names)` with names in full where that fits `_COLUMNS`, else
    with the longest ones aliased, fewer first."""
    text = ""
    for longest in (math.inf, 48, 36, 24, 0):
        text = render(_Names(checkpoints, longest))
        if max(map(len, text.splitlines())) <= _COLUMNS:
            break
    return text


def _wrap(text: str, indent: str, subsequent: str) -> str:
    return textwrap.fill(
        text,
        _COLUMNS,
        initial_indent=indent,
        subsequent_indent=subsequent,
        break_on_hyphens=False,
    )


def _table(table: Sequence[PlanEntry], chosen: PlanEntry | None, names: _Names) -> str:
    base = min(e.flops for e in table) or 1
    rows: list[tuple[str, ...]] = [
        ("", "checkpoint", "memory", "FLOPs", "vs fewest", "time", "fits")
    ]
    for e in table:
        star = chosen is not None and e.checkpoint == chosen.checkpoint
        rows.append(
            _row(star, names.short(e.checkpoint), format_memory(e))
            + (format_flops(e.flops), f"{e.flops / base:.2f}x", _time(e))
            + ("yes" if e.fits else "no",)
        )
    return _columns(rows)


def _frontier_table(
    points: Sequence[FrontierPoint], chosen: Planned, names: _Names
) -> str:
    rows: list[tuple[str, ...]] = [
        ("", "checkpoint", "predicted", "compiled", "FLOPs", "host", "time")
    ]
    for p in points:
        compiled = "-" if p.compiled_bytes is None else format_size(p.compiled_bytes)
        host = format_size(p.host_bytes) if p.host_bytes else "-"
        rows.append(
            _row(p.checkpoint == chosen, names.short(p.checkpoint))
            + (format_size(p.predicted_bytes), compiled, format_flops(p.flops))
            + (host, _time(p))
        )
    return _columns(rows)


def _batch_table(result: PlanResult, names: _Names) -> str:
    meshes = any(b.mesh is not None for b in result.batches)
    head = ("", "micro-batches", "loss chunk", "checkpoint", "compiled", "time")
    rows: list[tuple[str, ...]] = [head + (("mesh",) if meshes else ())]
    pick = (result.micro_batches, result.loss_chunk_size, result.checkpoint)
    for b in result.batches:
        star = (b.micro_batches, b.loss_chunk_size, b.checkpoint) == pick
        rows.append(
            _row(star and b.mesh == result.mesh, str(b.micro_batches))
            + (str(b.loss_chunk_size), names.short(b.checkpoint))
            + (format_size(b.memory_bytes), _time(b))
            + ((mesh_name(b.mesh),) if meshes else ())
        )
    return _columns(rows)


def _row(chosen: bool, *cells: str) -> tuple[str, ...]:
    return ("*" if chosen else "", *cells)


def _time(x: PlanEntry | FrontierPoint | BatchOption) -> str:
    return format_time(x.time_s) + ("" if x.measured else " (est.)")


def mesh_name(mesh: Any) -> str:
    """`"data 2 x fsdp 4"`: a mesh's axes and their sizes."""
    return " x ".join(f"{a} {n}" for a, n in mesh.shape.items())


def _columns(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows
    )


def format_memory(e: PlanEntry | Compiled) -> str:
    if e.memory_bytes is None:
        return "too large (XLA)"
    if e.report is not None:
        return format_bytes(e.memory_bytes)
    return f">= {format_bytes(e.memory_bytes)} (XLA)"

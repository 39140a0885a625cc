"""The memory-budget planner: the cheapest checkpointing that fits."""

import collections
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from ._binomial import binomial
from ._combinators import set_checkpoint
from ._memory import MemoryReport, memory_report
from ._schedules import Checkpoint, Schedule, every, nested, recursive


DEFAULT_CANDIDATES: tuple[Checkpoint, ...] = (
    None,
    "dots",
    "dots_no_batch",
    "nothing",
    every(2),
    every(4),
    every(8),
    every(16),
    nested(2),
    nested(3),
    recursive(),
    binomial(2),
    binomial(4),
    binomial(8),
    binomial(16),
    binomial(32),
)
"""What [`eqx_remat.plan`][] compares by default: no checkpointing, the policies
that save less than everything, and each schedule over a grid of parameters
(`"offload_dots_no_batch"` is added for TPU targets)."""


class PlanEntry(NamedTuple):
    """One candidate of a [`eqx_remat.PlanResult`][] table.

    **Attributes:**

    - `checkpoint`: the candidate (a policy name, policy or schedule, or `None`).
    - `memory_bytes`: device memory it needs: arguments + outputs + temporaries
      of the compiled function (per chip on a TPU target). Host memory that
      offloading uses is not counted.
    - `flops`: FLOPs of the function, loop trip counts and recomputation
      included (see [`eqx_remat.count_flops`][]; `binomial` schedules are counted
      exactly, as the evaluations they run).
    - `fits`: whether `memory_bytes <= budget_bytes`.
    - `report`: the full [`eqx_remat.MemoryReport`][] (its `flops` is
      `count_flops`'s, an upper bound for `binomial`).
    """

    checkpoint: Checkpoint
    memory_bytes: int
    flops: int
    fits: bool
    report: MemoryReport


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """What [`eqx_remat.plan`][] found.

    **Attributes:**

    - `checkpoint`: the chosen candidate: the fewest FLOPs among those that fit
      (ties go to less memory, then to the earlier candidate).
    - `entry`: its [`eqx_remat.PlanEntry`][].
    - `table`: every candidate's entry, in the order given.
    - `budget_bytes`: the budget, in bytes.
    - `target`: what was compiled for (`"cpu"`, `"gpu"`, `"v5e:2x2"`, ...).
    """

    checkpoint: Checkpoint
    entry: PlanEntry
    table: tuple[PlanEntry, ...]
    budget_bytes: int
    target: str

    def apply(self, tree: Any) -> Any:
        """`eqx_remat.set_checkpoint(tree, self.checkpoint)`: a copy of `tree`
        (e.g. the model) using the chosen checkpoint."""
        return set_checkpoint(tree, self.checkpoint)

    def __str__(self) -> str:
        head = (
            f"plan for a budget of {format_bytes(self.budget_bytes)} "
            f"[{self.target}]: checkpoint={_name(self.checkpoint)}"
        )
        return head + "\n" + _table(self.table, self.entry)


def format_bytes(n: int) -> str:
    """`n` bytes as a short binary-prefixed string, e.g. `"1.50 GiB"`."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_bytes(value: int | str, name: str = "budget_bytes") -> int:
    """A number of bytes from an `int` or a string such as `"16GiB"`, `"512 MiB"`,
    `"1.5GB"` or `"4096"` (binary `KiB`/`MiB`/`GiB`/`TiB`, decimal
    `KB`/`MB`/`GB`/`TB`, case-insensitive). Raises `ValueError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(
            f"{name} must be an int >= 0 or a string such as '16GiB'. "
            f"Got {value!r} of type {type(value).__name__}."
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be an int >= 0. Got {value}.")
        return value
    match = _BYTES.fullmatch(value)
    unit = match and match.group(2).lower()
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{name} must be an int or a string such as '16GiB', '512MiB' or "
            f"'1.5GB' (units: {', '.join(u for u in _UNITS if u)}). Got {value!r}."
        )
    return int(float(match.group(1)) * _UNITS[unit])


# Compilations are cached across calls: planning the same function for another
# budget compiles nothing.
_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 512


def _key(fn, args, target) -> Any:
    leaves, treedef = jtu.tree_flatten(args)
    avals = []
    for x in leaves:
        if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct):
            sharding = getattr(x, "sharding", None)
            avals.append(("array", np.shape(x), str(x.dtype), sharding))
        else:
            avals.append(("static", x))
    # By identity: functions need not be hashable (`eqx.filter_grad`'s are not).
    key = (id(fn), treedef, tuple(avals), target)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _measure(fn, args, target) -> tuple[MemoryReport, int]:
    key = _key(fn, args, target)
    if key is not None and key in _CACHE and _CACHE[key][0] is fn:
        _CACHE.move_to_end(key)
        return _CACHE[key][1:]
    report = memory_report(fn, *args, target=target)
    flops = int(report.flops)
    if key is not None:
        _CACHE[key] = fn, report, flops  # holding `fn` keeps its id unique
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return report, flops


def _has_checkpoint_field(tree: Any) -> bool:
    found = False

    def visit(x):
        nonlocal found
        if isinstance(x, eqx.Module):
            for f in dataclasses.fields(x):
                if f.name == "checkpoint":
                    found = True
                else:
                    jtu.tree_map(visit, getattr(x, f.name), is_leaf=_is_module)
        return x

    jtu.tree_map(visit, tree, is_leaf=_is_module)
    return found


def _is_module(x) -> bool:
    return isinstance(x, eqx.Module)


def plan(
    fn: Callable[..., Any],
    *args: Any,
    budget_bytes: int | str,
    target: str | None = None,
    candidates: Sequence[Checkpoint] | None = None,
) -> PlanResult:
    """The cheapest checkpointing that fits a memory budget.

    For each candidate, every `checkpoint` field in `args` is set to it (with
    [`eqx_remat.set_checkpoint`][]), `fn(*args)` is compiled ahead of time
    ([`eqx_remat.memory_report`][]: nothing is allocated or run) and its FLOPs are
    counted ([`eqx_remat.count_flops`][]). The candidate with the fewest FLOPs
    among those whose memory fits the budget wins.

    Pass the function whose memory matters — a gradient or training step, e.g.
    `eqx.filter_grad(loss)` — and the model among its arguments:

    ```python
    result = eqx_remat.plan(
        eqx.filter_grad(loss), model, batch, budget_bytes="16GiB", target="v5e"
    )
    print(result)  # the table
    model = result.apply(model)
    ```

    Compilations are cached: planning the same function and argument shapes
    again (another budget, a subset of the candidates) compiles nothing new.

    **Arguments:**

    - `fn`: the function to plan for.
    - `*args`: its arguments; at least one must contain an `eqx.Module` with a
      `checkpoint` field (every zoo model has one). Array leaves may be
      `jax.ShapeDtypeStruct`s.
    - `budget_bytes`: device memory available (per chip on a TPU target): an int,
      or a string such as `"16GiB"`, `"512MiB"` or `"1.5GB"`. A candidate fits
      when its arguments, outputs and temporaries add up to at most this.
    - `target`: `None` for the default backend, or `"v5e"` / `"v5e:AxB"` to
      compile for TPU v5e without a TPU (see [`eqx_remat.memory_report`][]).
    - `candidates`: the checkpoints to compare (policy names, policies,
      schedules, `None`); default [`eqx_remat.DEFAULT_CANDIDATES`][] (plus
      `"offload_dots_no_batch"` for a TPU target).

    **Returns:**

    A [`eqx_remat.PlanResult`][]: the chosen `checkpoint`, its entry, and the
    whole table (`print` it).

    **Raises:**

    `ValueError` for a bad budget, an invalid or empty list of candidates, or
    arguments without a `checkpoint` field; and, when no candidate fits, a
    `ValueError` that names the smallest achievable memory, and its candidate.
    """
    budget = parse_bytes(budget_bytes)
    if candidates is None:
        candidates = DEFAULT_CANDIDATES
        if target is not None:
            candidates = candidates + ("offload_dots_no_batch",)
    candidates = tuple(candidates)
    if not candidates:
        raise ValueError("plan expected at least one candidate. Got none.")
    for i, c in enumerate(candidates):
        if not isinstance(c, Schedule):
            try:
                set_checkpoint(None, c)
            except ValueError as e:
                raise ValueError(f"plan: invalid candidates[{i}]. {e}") from None
    if not _has_checkpoint_field(args):
        raise ValueError(
            "plan expected arguments containing an eqx.Module with a `checkpoint` "
            "field (every zoo model has one), whose checkpoint it varies. Got none."
        )

    table = []
    for c in candidates:
        report, flops = _measure(fn, set_checkpoint(args, c), target)
        memory = report.temp_bytes + report.argument_bytes + report.output_bytes
        table.append(PlanEntry(c, memory, flops, memory <= budget, report))
    target_name = table[0].report.target

    fitting = [e for e in table if e.fits]
    if not fitting:
        best = min(table, key=lambda e: e.memory_bytes)
        raise ValueError(
            f"No candidate fits in budget_bytes={format_bytes(budget)} "
            f"[{target_name}]. The smallest achievable memory is "
            f"{format_bytes(best.memory_bytes)} ({best.memory_bytes} bytes), with "
            f"checkpoint={_name(best.checkpoint)}.\n" + _table(table, None)
        )
    order = {id(e): i for i, e in enumerate(table)}
    chosen = min(fitting, key=lambda e: (e.flops, e.memory_bytes, order[id(e)]))
    return PlanResult(chosen.checkpoint, chosen, tuple(table), budget, target_name)


def _name(c: Checkpoint) -> str:
    return repr(c) if c is None or isinstance(c, str) else str(c)


def _table(table: Sequence[PlanEntry], chosen: PlanEntry | None) -> str:
    base = min(e.flops for e in table) or 1
    rows = [("", "checkpoint", "memory", "FLOPs", "vs fewest", "fits")]
    for e in table:
        rows.append(
            (
                "*" if e is chosen else "",
                _name(e.checkpoint),
                format_bytes(e.memory_bytes),
                _format_flops(e.flops),
                f"{e.flops / base:.2f}x",
                "yes" if e.fits else "no",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows
    )


def _format_flops(n: int) -> str:
    for unit, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)

"""The memory-budget planner: the cheapest checkpointing that fits."""

import collections
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, SupportsIndex

import jax
import jax.tree_util as jtu
import numpy as np

from ._binomial import binomial
from ._checkpoint import (
    Checkpoint,
    check_checkpoint,
    map_checkpoints,
    set_checkpoint,
)
from ._flops import count_flops
from ._memory import MemoryReport, memory_report
from ._schedules import every, nested, recursive
from ._util import format_bytes, format_flops, is_array_like
from ._validate import check_int


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
      offloading uses is not counted. For a candidate that XLA refused to
      compile because it does not fit in one device (`RESOURCE_EXHAUSTED`),
      XLA's own figure of what it needed (its temporaries: a lower bound), or
      `None` where XLA's message gives none.
    - `flops`: FLOPs of the function, loop trip counts and recomputation
      included: [`eqx_remat.count_flops`][], exact for every schedule.
    - `fits`: whether `memory_bytes <= budget_bytes` (always `False` for a
      candidate XLA refused to compile).
    - `report`: the full [`eqx_remat.MemoryReport`][], or `None` for a candidate
      XLA refused to compile.
    - `error`: XLA's message for a candidate it refused to compile, else `None`.
    """

    checkpoint: Checkpoint
    memory_bytes: int | None
    flops: int
    fits: bool
    report: MemoryReport | None
    error: str | None = None


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


def parse_bytes(value: SupportsIndex | str, name: str = "budget_bytes") -> int:
    """A number of bytes from an integer or a string: the parser behind
    [`eqx_remat.plan`][]'s `budget_bytes`, for command lines that take sizes.

    **Arguments:**

    - `value`: an integer `>= 0`, or a string such as `"16GiB"`, `"512 MiB"`,
      `"1.5GB"` or `"4096"` (binary `KiB`/`MiB`/`GiB`/`TiB`, decimal
      `KB`/`MB`/`GB`/`TB`, case-insensitive).
    - `name`: what to call the value in an error message.

    **Returns:**

    The number of bytes, an `int`.

    **Raises:**

    `ValueError` naming `name`, with examples of what is accepted.
    """
    if not isinstance(value, str):
        try:
            return check_int("plan", name, value, 0)
        except ValueError:
            raise ValueError(
                f"{name} must be an int >= 0 or a string such as '16GiB'. "
                f"Got {value!r} of type {type(value).__name__}."
            ) from None
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
        if is_array_like(x):
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


def _measure(fn, args, target) -> tuple[MemoryReport | str, int]:
    """The candidate's report (or XLA's RESOURCE_EXHAUSTED message) and FLOPs."""
    key = _key(fn, args, target)
    if key is not None and key in _CACHE and _CACHE[key][0] is fn:
        _CACHE.move_to_end(key)
        return _CACHE[key][1:]
    try:
        report = memory_report(fn, *args, target=target)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        report = str(e)
    # memory_report counts the FLOPs too; a refused candidate is counted alone.
    flops = int(count_flops(fn, *args) if isinstance(report, str) else report.flops)
    if key is not None:
        _CACHE[key] = fn, report, flops  # holding `fn` keeps its id unique
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return report, flops


# What XLA says it needed, in its RESOURCE_EXHAUSTED messages: "the total memory
# required for HLO temporaries (16.00G) exceeds available HBM (15.75G)", "Used
# 17.5G of 15.75G hbm".
_NEEDED = (
    re.compile(r"required for [^(]*\((\d+(?:\.\d+)?)([KMGT]?)i?B?\)"),
    re.compile(r"Used (\d+(?:\.\d+)?)([KMGT]?)i?B? of"),
)
_XLA_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def needed_bytes(message: str) -> int | None:
    """The bytes XLA says a program needed, from its RESOURCE_EXHAUSTED `message`
    (the error `memory_report` raises when a program does not fit in one
    device), or `None` where the message gives no figure."""
    for pattern in _NEEDED:
        match = pattern.search(message)
        if match is not None:
            return int(float(match.group(1)) * _XLA_UNITS[match.group(2)])
    return None


def plan(
    fn: Callable[..., Any],
    *args: Any,
    budget_bytes: SupportsIndex | str,
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
    A candidate that XLA refuses to compile because it does not fit in one
    device (`RESOURCE_EXHAUSTED`, e.g. `None` for a large model on TPU v5e) is
    not an error: it is recorded as not fitting, with XLA's figure of what it
    needed, and planning goes on.
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
        check_checkpoint(c, name=f"plan: invalid candidates[{i}]:")
    if not map_checkpoints(args, lambda c: c)[1]:
        raise ValueError(
            "plan expected arguments containing an eqx.Module with a `checkpoint` "
            "field (every zoo model has one), whose checkpoint it varies. Got none."
        )

    table = []
    for c in candidates:
        report, flops = _measure(fn, set_checkpoint(args, c), target)
        if isinstance(report, str):  # XLA: does not fit in one device
            needed = needed_bytes(report)
            table.append(PlanEntry(c, needed, flops, False, None, report))
            continue
        memory = report.total_bytes
        table.append(PlanEntry(c, memory, flops, memory <= budget, report))
    target_name = _target_name(table, target)

    fitting = [e for e in table if e.fits]
    if not fitting:
        measured = [e for e in table if e.report is not None]
        if not measured:
            raise ValueError(
                f"No candidate fits in budget_bytes={format_bytes(budget)} "
                f"[{target_name}]: XLA refused to compile every one of them "
                "(RESOURCE_EXHAUSTED: larger than one device's memory).\n"
                + _table(table, None)
            )
        best = min(measured, key=lambda e: e.memory_bytes)
        raise ValueError(
            f"No candidate fits in budget_bytes={format_bytes(budget)} "
            f"[{target_name}]. The smallest achievable memory is "
            f"{format_bytes(best.memory_bytes)} ({best.memory_bytes} bytes), with "
            f"checkpoint={_name(best.checkpoint)}.\n" + _table(table, None)
        )
    order = {id(e): i for i, e in enumerate(table)}
    chosen = min(fitting, key=lambda e: (e.flops, e.memory_bytes, order[id(e)]))
    return PlanResult(chosen.checkpoint, chosen, tuple(table), budget, target_name)


def _target_name(table: Sequence[PlanEntry], target: str | None) -> str:
    for e in table:
        if e.report is not None:
            return e.report.target
    return jax.default_backend() if target is None else str(target)


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
                _format_memory(e),
                format_flops(e.flops),
                f"{e.flops / base:.2f}x",
                "yes" if e.fits else "no",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows
    )


def _format_memory(e: PlanEntry) -> str:
    if e.memory_bytes is None:
        return "too large (XLA)"
    if e.report is not None:
        return format_bytes(e.memory_bytes)
    return f">= {format_bytes(e.memory_bytes)} (XLA)"

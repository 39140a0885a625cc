"""The memory-budget planner: the cheapest checkpointing that fits."""

import collections
import dataclasses
import math
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn, SupportsIndex

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
from ._engine import Schedule
from ._flops import count_flops
from ._hardware import hardware
from ._memory import (
    MemoryReport,
    ReplicatedArgumentsWarning,
    _v5e,
    memory_report,
    traced_for,
    warn_replicated,
)
from ._policies import save_names
from ._ranges import ranges
from ._schedules import every, nested, recursive
from ._solve import (
    Option,
    Predict,
    Real,
    best_mix,
    linear,
    lower_hull,
    option_time,
    per_layer_options,
    prefix_options,
    price,
    share_per_chip,
    stack_depths,
)
from ._util import format_bytes, format_flops, is_array_like, split_args
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
"""No checkpointing, the policies that save less than everything, and each
schedule over a grid of parameters. When [`eqx_remat.plan`][] solves, its
schedules are the whole-stack options it compares with its pick (those that
make sense at the stack's depth: `every(k)` and `binomial(s)` below it); pass
`candidates=eqx_remat.DEFAULT_CANDIDATES` to compile and compare all of them
instead."""


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
      candidate XLA refused to compile).
    - `report`: the full [`eqx_remat.MemoryReport`][], or `None` for a candidate
      XLA refused to compile.
    - `error`: XLA's message for a candidate it refused to compile, else `None`.
    - `time_s`: the estimated step time on one chip: its FLOPs at the target's
      peak (its share of them, per chip) plus the bytes it offloads
      (`report.host_temp_bytes`) over the host link, out and back (see
      [`eqx_remat.plan`][]).
    """

    checkpoint: Checkpoint
    memory_bytes: int | None
    flops: int
    fits: bool
    report: MemoryReport | None
    error: str | None = None
    time_s: float = 0.0


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
      schedules and the pick, [`eqx_remat.count_flops`][]; summed per layer
      for another mix).
    - `host_bytes`: bytes per chip it offloads to host memory.
    - `time_s`: the estimated step time on one chip (see [`eqx_remat.plan`][]).
    """

    checkpoint: Checkpoint
    predicted_bytes: int
    compiled_bytes: int | None
    flops: int
    host_bytes: int
    time_s: float


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """What [`eqx_remat.plan`][] found.

    **Attributes:**

    - `checkpoint`: the pick: the least estimated step time among what fits
      the budget.
    - `entry`: its [`eqx_remat.PlanEntry`][] (it is always compiled).
    - `table`: with `candidates=`, every candidate's entry in the order given;
      else `()`.
    - `budget_bytes`: the budget, in bytes.
    - `target`: what was compiled for (`"cpu"`, `"gpu"`, `"v5e:2x2"`, ...).
    - `frontier`: the Pareto frontier of memory and estimated time that the
      planner found, least memory first, as [`eqx_remat.FrontierPoint`][]s
      (`()` with `candidates=`).
    - `notes`: what the planner wants you to know: stacks it could not mix,
      picks that did not fit when compiled and what it did instead.
    - `compiles`: how many functions it compiled (compilations cached from an
      earlier call are not counted).
    - `seconds`: how long it took.
    """

    checkpoint: Checkpoint
    entry: PlanEntry
    table: tuple[PlanEntry, ...]
    budget_bytes: int
    target: str
    frontier: tuple[FrontierPoint, ...] = ()
    notes: tuple[str, ...] = ()
    compiles: int = 0
    seconds: float = 0.0

    def apply(self, tree: Any) -> Any:
        """`eqx_remat.set_checkpoint(tree, self.checkpoint)`: a copy of `tree`
        (e.g. the model) using the chosen checkpoint."""
        return set_checkpoint(tree, self.checkpoint)

    def __str__(self) -> str:
        e = self.entry
        lines = [
            f"plan for a budget of {format_bytes(self.budget_bytes)} "
            f"[{self.target}]: checkpoint={_name(self.checkpoint)}"
        ]
        if self.frontier:
            lines.append(
                f"  {format_bytes(e.memory_bytes or 0)} compiled, "
                f"{format_flops(e.flops)} FLOPs, estimated "
                f"{_format_time(e.time_s)} per step"
            )
        lines += [f"  note: {n}" for n in self.notes]
        if self.frontier:
            lines += ["frontier:", _frontier_table(self.frontier, self.checkpoint)]
        if self.table:
            lines.append(_table(self.table, self.entry))
        return "\n".join(lines)


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
# A call compiles at most this many mixes that do not fit, then chooses among
# uniform options (each compile of a large model on TPU v5e takes minutes).
_MIX_TRIES = 6
_CACHE_SIZE = 512
# And so are the planner's traces (stacks, prices).
_PRICES: collections.OrderedDict = collections.OrderedDict()


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


def _measure(fn, args, target) -> tuple[MemoryReport | str, int, bool]:
    """The candidate's report (or XLA's RESOURCE_EXHAUSTED message), FLOPs, and
    whether it was compiled now (`False`: from the cache)."""
    key = _key(fn, args, target)
    if key is not None and key in _CACHE and _CACHE[key][0] is fn:
        _CACHE.move_to_end(key)
        return (*_CACHE[key][1:], False)
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
    return report, flops, True


# What XLA says it needed, in its RESOURCE_EXHAUSTED messages: "the total memory
# required for HLO temporaries (16.00G) exceeds available HBM (15.75G)", "Used
# 17.5G of 15.75G hbm".
_NEEDED = (
    re.compile(r"required for [^(]*\((\d+(?:\.\d+)?)([KMGT]?)i?B?\)"),
    re.compile(r"Used (\d+(?:\.\d+)?)([KMGT]?)i?B? of"),
)
# And what it says one device has.
_AVAILABLE = (
    re.compile(r"exceeds available [A-Za-z]* ?\((\d+(?:\.\d+)?)([KMGT]?)i?B?\)"),
    re.compile(r"Used \S+ of (\d+(?:\.\d+)?)([KMGT]?)i?B?"),
)
_XLA_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _xla_bytes(message: str, patterns: Sequence[re.Pattern]) -> int | None:
    for pattern in patterns:
        match = pattern.search(message)
        if match is not None:
            return int(float(match.group(1)) * _XLA_UNITS[match.group(2)])
    return None


def needed_bytes(message: str) -> int | None:
    """The bytes XLA says a program needed, from its RESOURCE_EXHAUSTED `message`
    (the error `memory_report` raises when a program does not fit in one
    device), or `None` where the message gives no figure."""
    return _xla_bytes(message, _NEEDED)


def plan(
    fn: Callable[..., Any],
    *args: Any,
    budget_bytes: SupportsIndex | str,
    target: str | None = None,
    candidates: Sequence[Checkpoint] | None = None,
    progress: bool = True,
) -> PlanResult:
    """The checkpoint with the least estimated step time that fits a memory
    budget: a byte budget in, the checkpoint to train with out.

    Pass the function whose memory matters — a gradient or training step, e.g.
    `eqx.filter_grad(loss)` — and the model among its arguments:

    ```python
    result = eqx_remat.plan(
        eqx.filter_grad(loss), model, batch, budget_bytes="16GiB", target="v5e"
    )
    print(result)  # the pick, and the frontier of memory against time
    model = result.apply(model)
    ```

    **How it solves.** In a stack of `D` identical layers, the memory and the
    cost of giving different layers different checkpoints are a base plus a
    per-layer term per layer, so at a budget the best choice mixes at most two
    per-layer options that are neighbours on the lower convex hull of
    (per-layer bytes, per-layer cost). The planner:

    1. traces `fn` once to find its stacks (every `checkpoint` field in `args`
       set to a probe that records each stack's depth);
    2. prices each per-layer option once, by tracing, without compiling: the
       policies `None`, `"dots"`, `"dots_no_batch"`, `"nothing"` (and
       `"offload_dots_no_batch"` on a target with a host link: TPU, GPU), and
       per-name decisions over the `checkpoint_name` tags of the model
       ([`eqx_remat.save_names`][] of each tag, then of the tags that save the
       most recomputation per byte first; with a host link,
       [`eqx_remat.offload_names`][] of the same). Bytes: what the option keeps
       across the stack in `fn`'s program, per layer. Cost: its FLOPs beyond
       `None`'s ([`eqx_remat.count_flops`][], exact) at the target's peak
       FLOP/s, plus what it offloads, out and back over the host link.
    3. compiles the cheapest option (`None`) and the lightest, for the base
       memory (compiled memory = base + `D` × the option's bytes per layer);
    4. picks the cheapest mix the model predicts to fit: `D - n` layers of a
       lighter option and, above them, `n` of a heavier, cheaper one, as
       `eqx_remat.ranges((D - n, light), (n, heavy))` (a uniform option when
       `n` is 0), `n` as large as the budget allows. The heavy layers go last
       because they are reversed first, while everything saved is still held:
       there, the option that recomputes less needs less working memory.
       With real layer counts the best pair is two neighbours on the lower
       convex hull; with whole layers rounding can favour another pair, so
       every pair of options on the Pareto front is tried (no compile);
    5. compiles what the pick depends on: its two options, uniform (their base
       memory is then exact; a mix needs the larger of its two phases: the
       heavy layers reversed beside everything saved, then the light ones), then
       the mix itself. What a compiled mix needed beyond the prediction (or
       short of it) corrects the next predictions: for mixes of the same two
       options, interpolated over the counts compiled; for other mixes with
       the same heavy option, by its largest error; for the rest, by the
       largest excess seen. These corrections are kept for later calls with
       the same function; after 6 mixes that do not fit in one call, it
       chooses among uniform options. A mix that does not fit when compiled is
       retried with as many fewer heavy layers as the compiled excess says,
       and said so, in `notes` and on stderr; the pick changes as the
       compiles teach;
    6. compares the pick with the whole-stack schedules of
       [`eqx_remat.DEFAULT_CANDIDATES`][] that cost less (their FLOPs are
       counted; they are compiled only when they could win).

    The estimated step time is per chip and at peak: the function's FLOPs (the
    chip's share: all of them, or `1/k` of them when an argument is split `k`
    ways over the chips) over the chip's peak FLOP/s, plus `2 × offloaded
    bytes / host-link bandwidth`. The figures per target are in one table,
    with their sources (TPU v5e: 197 TFLOP/s bf16 per chip; CPU: a nominal
    100 GFLOP/s). It ranks checkpoints; it is not a prediction of wall time.

    With `candidates=`, the planner enumerates instead: each candidate is
    compiled, and the one with the least estimated step time that fits wins
    (the table of all of them is in the result).

    Stacks of different depths in one function cannot share a mix: the
    planner then compares uniform options only, and says so in `notes`.
    Compilations are cached: planning the same function and argument shapes
    again (another budget) compiles only what is new.

    **Arguments:**

    - `fn`: the function to plan for; it must differentiate the stacks.
    - `*args`: its arguments; at least one must contain an `eqx.Module` with a
      `checkpoint` field (every zoo model has one). Array leaves may be
      `jax.ShapeDtypeStruct`s. On a target with several chips, give the batch
      a sharding (`zoo.shard_batch(batch, eqx_remat.v5e_mesh(target))`): an
      [`eqx_remat.ReplicatedArgumentsWarning`][] says when nothing is split.
    - `budget_bytes`: device memory available (per chip on a TPU target): an int,
      or a string such as `"16GiB"`, `"512MiB"` or `"1.5GB"`. A checkpoint fits
      when its arguments, outputs and temporaries add up to at most this.
    - `target`: `None` for the default backend, or `"v5e"` / `"v5e:AxB"` to
      compile for TPU v5e without a TPU (see [`eqx_remat.memory_report`][]).
    - `candidates`: `None` to solve; or the checkpoints to compare (policy
      names, policies, schedules, `None`), each compiled.
    - `progress`: print what it does, how many and how long, to stderr.

    **Returns:**

    A [`eqx_remat.PlanResult`][]: the pick, its compiled entry, the frontier
    (or the candidates' table), notes, compile count and time. `print` it.

    **Raises:**

    `ValueError` for a bad budget, an invalid or empty list of candidates,
    arguments without a `checkpoint` field, or a function that differentiates
    no stack (when solving); and, when nothing fits, a `ValueError` that names
    the smallest achievable memory and its checkpoint. A checkpoint that XLA
    refuses to compile because it does not fit in one device
    (`RESOURCE_EXHAUSTED`) is not an error: it is recorded as not fitting,
    with XLA's figure of what it needed, and planning goes on.
    """
    budget = parse_bytes(budget_bytes)
    if candidates is not None:
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
    planner = _Planner(fn, args, budget, target, _Progress(progress))
    with warnings.catch_warnings(), traced_for(target):
        # Said once, by the planner; not again for every compile.
        warnings.simplefilter("ignore", ReplicatedArgumentsWarning)
        if candidates is not None:
            return planner.enumerate(candidates)
        return planner.solve()


class _Progress:
    """Plain lines on stderr (`plan: ...`), when enabled."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"plan: {message}", file=sys.stderr, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class _Planner:
    """One call of `plan`: the function, the budget, the target's figures, what
    was compiled, and what to tell the user."""

    def __init__(self, fn, args, budget: int, target, progress: _Progress):
        self.fn, self.args, self.budget, self.say = fn, args, budget, progress
        self.hw, known = hardware(target)
        self.target = target
        chips = 1
        if target is not None and target not in ("cpu", "gpu", "tpu"):
            name, mesh = _v5e(target)
            chips = mesh.size
            warn_replicated("plan", name, mesh, split_args(args)[0], stacklevel=4)
        self.share = share_per_chip(args, chips)
        self.host = self.hw.host_bytes_per_s is not None
        self.compiled: dict[Any, tuple[PlanEntry, float | None]] = {}
        self.notes: list[str] = []
        self.compiles = 0
        # Each compiled mix, `ranges((D - n, light), (n, heavy))`: its memory.
        self.mixes: dict[ranges, int] = {}
        if not known:
            self.note(
                f"this device's figures are unknown; priced as {self.hw.kind} "
                f"({self.hw.source})"
            )

    def note(self, message: str) -> None:
        self.notes.append(message)
        self.say(f"note: {message}")

    def time_s(self, flops: Real, host_bytes: Real) -> float:
        return option_time(self.hw, self.share * flops, host_bytes)

    def measure(self, c: Checkpoint, predicted: Real | None = None) -> PlanEntry:
        """Compile `c` (or take it from the cache): its entry."""
        if c in self.compiled:
            return self.compiled[c][0]
        start = time.perf_counter()
        args = set_checkpoint(self.args, c)
        report, flops, fresh = _measure(self.fn, args, self.target)
        self.compiles += fresh
        entry = self._entry(c, report, flops)
        self.compiled[c] = (entry, predicted)
        what = "does not fit in one chip" if entry.report is None else "compiled"
        pred = (
            "" if predicted is None else f" (predicted {format_bytes(int(predicted))})"
        )
        self.say(
            f"{what}: {_name(c)}: {_format_memory(entry)}{pred}, "
            f"{'fits' if entry.fits else 'does not fit'} "
            f"({time.perf_counter() - start:.1f} s)"
        )
        return entry

    def _entry(self, c: Checkpoint, report, flops: int) -> PlanEntry:
        if isinstance(report, str):  # XLA: does not fit in one device
            available = _xla_bytes(report, _AVAILABLE)
            if available is not None and available < self.budget:
                self.note(
                    f"the budget, {format_bytes(self.budget)}, is more than one "
                    f"device holds: XLA says {format_bytes(available)}; planning "
                    "for that"
                )
                self.budget = available
            t = self.time_s(flops, 0)
            return PlanEntry(c, needed_bytes(report), flops, False, None, report, t)
        memory = report.total_bytes
        t = self.time_s(flops, report.host_temp_bytes)
        return PlanEntry(c, memory, flops, memory <= self.budget, report, None, t)

    def enumerate(self, candidates: Sequence[Checkpoint]) -> PlanResult:
        self.say(f"compiling {len(candidates)} candidates for {self._target()}")
        table = tuple(self.measure(c) for c in candidates)
        fitting = [e for e in table if e.fits]
        if not fitting:
            _raise_nothing_fits(table, self.budget, _target_name(table, self.target))
        order = {id(e): i for i, e in enumerate(table)}
        chosen = min(
            fitting, key=lambda e: (e.time_s, e.flops, e.memory_bytes, order[id(e)])
        )
        return self._result(chosen, table, ())

    # --- solving ------------------------------------------------------------

    def solve(self) -> PlanResult:
        self.say("tracing the function to find its stacks")
        depths = self._cached("depths", lambda: stack_depths(self.fn, self.args))
        if not depths:
            raise ValueError(
                "plan expected fn to differentiate the stacks of the modules in "
                "its arguments (pass a gradient or training step, e.g. "
                "eqx.filter_grad(loss)). Got a function whose backward pass runs "
                "no checkpointed stack."
            )
        self.depths = frozenset(depths)
        self.mixes = self._cached("mixes", dict)  # shared by later calls
        self.per = depths[0] if len(self.depths) == 1 else 1
        mix = (lambda parts: ranges(*parts)) if self.per > 1 else None
        if len(self.depths) > 1:
            self.note(
                f"stacks of different depths ({', '.join(map(str, depths))}) "
                "cannot share layer ranges: comparing uniform options only"
            )
        elif mix is None and self.per > 1:
            self.note("layer ranges are not available: uniform options only")
        link = self.hw.host_bytes_per_s
        self.say(
            f"{len(depths)} stack(s) of {'/'.join(map(str, depths))} layers; "
            f"priced as {self.hw.kind}: {self.hw.peak_flops / 1e12:g} TFLOP/s"
            + ("" if link is None else f", host link {link / 1e9:g} GB/s")
            + " per chip"
        )
        options = self._price_options()
        hull = lower_hull(options)
        self.say("lower convex hull: " + ", ".join(_name(o.checkpoint) for o in hull))
        pick = self._choose(options, mix)
        if pick is not None:
            pick = self._cheapest_compiled(pick, options)
        pick = self._try_schedules(pick, self._price_schedules())
        if pick is None:
            table = [e for e, _ in self.compiled.values()]
            _raise_nothing_fits(table, self.budget, _target_name(table, self.target))
        points = [self._uniform_point(o) for o in hull] + self._compiled_points()
        entry = self.compiled[pick.checkpoint][0]
        return self._result(entry, (), _pareto(points + [pick]))

    def _cached(self, what: Any, compute: Callable[[], Any]) -> Any:
        """`compute()`, remembered across calls for the same function, argument
        shapes and target (planning another budget traces nothing again)."""
        key = (_key(self.fn, self.args, self.target), what)
        if key[0] is None:
            return compute()
        if key in _PRICES and _PRICES[key][0] is self.fn:
            return _PRICES[key][1]
        _PRICES[key] = self.fn, compute()
        if len(_PRICES) > _CACHE_SIZE:
            _PRICES.popitem(last=False)
        return _PRICES[key][1]

    def _price(self, c: Checkpoint) -> tuple[Option, list[str]]:
        start = time.perf_counter()
        device, host, flops, names = self._cached(
            ("price", c), lambda: price(self.fn, self.args, c, self.depths)
        )
        if c is None:
            self.flops_none = flops
        extra = (flops - self.flops_none) / self.per
        host_layer = self.share * host / self.per
        o = Option(
            c,
            self.share * device / self.per,
            host_layer,
            extra,
            self.time_s(extra, host_layer),
            flops,
        )
        self.say(
            f"priced {_name(c)}: {format_bytes(int(o.bytes))}/layer"
            + (f" + {format_bytes(int(host_layer))} on the host" if host else "")
            + f", +{format_flops(max(extra, 0))} FLOPs/layer "
            f"({time.perf_counter() - start:.1f} s)"
        )
        return o, names

    def _price_options(self) -> list[Option]:
        none, names = self._price(None)
        rest = per_layer_options(names, self.host)[1:]
        self.say(
            f"pricing {len(rest) + 1} per-layer options by tracing (no compiles); "
            f"tags: {', '.join(names) or 'none'}"
        )
        priced = [none] + [self._price(c)[0] for c in rest]
        by = {o.checkpoint: o for o in priced}
        nothing = by["nothing"]
        singles = [
            (
                t,
                by[save_names(t)].bytes - nothing.bytes,
                nothing.flops - by[save_names(t)].flops,
            )
            for t in names
        ]
        more = prefix_options(singles, self.host) if len(names) > 1 else []
        if more:
            self.say(f"pricing {len(more)} more: tags saved best-first")
        priced += [self._price(c)[0] for c in more]
        self.priced = {o.checkpoint: o for o in priced}
        return priced

    def _base(self, o: Option) -> float | None:
        """Memory besides the stack's saved values, learnt from compiled uniform
        options: exact for a compiled one (from XLA's figure, a lower bound,
        for one XLA refused; infinite where it gave none), interpolated in
        bytes between compiled ones otherwise. `None` before any compile."""
        known = []
        for c, (entry, _) in self.compiled.items():
            if c in self.priced and (entry.report is not None or c == o.checkpoint):
                v = self.priced[c]
                memory = math.inf if entry.memory_bytes is None else entry.memory_bytes
                if c == o.checkpoint:
                    return memory - self.per * v.bytes
                known.append((v.bytes, memory - self.per * v.bytes))
        if not known:
            return None
        known.sort()
        below = [k for k in known if k[0] <= o.bytes]
        above = [k for k in known if k[0] >= o.bytes]
        if not below or not above:
            return (below or above)[-1 if below else 0][1]
        (b0, m0), (b1, m1) = below[-1], above[0]
        return m0 if b1 == b0 else m0 + (m1 - m0) * (o.bytes - b0) / (b1 - b0)

    def _predictor(self) -> Predict:
        """The memory of a mix as the planner predicts it now: the model
        (`mix_memory`, from each option's base), corrected by what compiled
        mixes (this call's and earlier calls' for the same function) taught.
        XLA's memory is not exactly the model's: per layer it may keep more or
        less than the option's price, and an option XLA refused on every layer
        has only a lower bound for a base. So where mixes of the same two
        options were compiled, the model's error is interpolated over their
        counts (see `_line`); for another pair with the same heavy option, its
        largest error there; for any other pair, the largest excess of any
        compiled mix over the model (none if no mix needed more): evidence
        that the next mix will need it too."""
        bases = {c: self._base(o) or 0.0 for c, o in self.priced.items()}
        model = linear(lambda o: bases[o.checkpoint], self.per)
        errors: dict[tuple, dict[int, float]] = {}  # (light, heavy): {n: error}
        for c, memory in self.mixes.items():
            (_, light), (n, heavy) = c.parts
            if light in self.priced and heavy in self.priced:
                lo, hi = self.priced[light], self.priced[heavy]
                error = memory - float(model(lo, hi, np.array(n)))
                errors.setdefault((light, heavy), {})[n] = error
        by_heavy: dict[Checkpoint, float] = {}
        for (_, heavy), at in errors.items():
            by_heavy[heavy] = max(by_heavy.get(heavy, -math.inf), *at.values())
        margin = max([0.0, *by_heavy.values()])

        def predict(light: Option, heavy: Option, n: np.ndarray) -> np.ndarray:
            memory = model(light, heavy, n)
            if light == heavy:
                return memory
            at = errors.get((light.checkpoint, heavy.checkpoint))
            if at:
                return np.asarray(memory + _line(n, at))
            return np.asarray(memory + by_heavy.get(heavy.checkpoint, margin))

        return predict

    def _predict(self, o: Option) -> float | None:
        """Predicted memory of `o` on every layer, or `None` before anything
        was compiled (the base is unknown)."""
        base = self._base(o)
        return None if base is None else base + self.per * o.bytes

    def _choose(self, options: list[Option], mix) -> FrontierPoint | None:
        """The cheapest mix predicted to fit, confirmed by compiling: solve,
        compile what the answer depends on (its options, uniform, for their
        base memory; then the mix itself), solve again with what that taught,
        until the answer compiled fits."""
        hull = lower_hull(options)
        for o in (hull[-1], hull[0]):  # the cheapest and the lightest
            self.measure(o.checkpoint, self._predict(o))
        # Without layer ranges, no mixes: at most 0 layers of a heavier option.
        limits: dict[tuple, int] = {}
        most = self.per if mix is not None else 0
        failed = 0
        for _ in range(4 * len(options) + 8):
            if most and failed == _MIX_TRIES:
                most = 0
                self.note(
                    f"{failed} mixes did not fit when compiled: XLA's memory is "
                    "not the model's here; choosing among uniform options"
                )
            best = best_mix(
                options,
                self._predictor(),
                self.per,
                self.budget,
                lambda light, heavy: min(limits.get((light, heavy), most), most),
            )
            if best is None:
                return None
            ends = (best.light,) if best.n == 0 else (best.light, best.heavy)
            new = [o for o in ends if o.checkpoint not in self.compiled]
            for o in new:
                self.measure(o.checkpoint, self._predict(o))
            if new:
                continue
            if best.n == 0:
                return self._uniform_point(best.light)
            point, fewer = self._try_mix(best, mix)
            if point is not None:
                return point
            limits[(best.light, best.heavy)] = fewer
            failed += 1
        raise AssertionError("plan: the search for a mix did not settle")

    def _try_mix(self, best, mix) -> tuple[FrontierPoint | None, int]:
        """Compile the mix `best`: `(its point, n)` if it fits, else `(None,
        the most heavy layers worth trying next)`, stepping by as many layers
        as the compiled excess says."""
        light, heavy, n = best.light, best.heavy, best.n
        c = mix(((self.per - n, light.checkpoint), (n, heavy.checkpoint)))
        point = self._mix_point(c, n, heavy, light, best.predicted)
        entry = self.measure(c, point.predicted_bytes)
        if entry.report is not None:
            self.mixes[c] = entry.report.total_bytes
        if entry.fits:
            return point._replace(compiled_bytes=entry.memory_bytes), n
        excess = (entry.memory_bytes or self.budget + 1) - self.budget
        step = max(1, math.ceil(excess / max(heavy.bytes - light.bytes, 1)))
        fewer = max(n - step, 0)
        self.note(
            f"{_name(c)} was predicted to fit "
            f"({format_bytes(point.predicted_bytes)}) but compiled to "
            f"{_format_memory(entry)}: at most {fewer} layers of "
            f"{_name(heavy.checkpoint)} with {_name(light.checkpoint)}"
        )
        return None, fewer

    def _uniform_point(self, o: Option) -> FrontierPoint:
        entry = self.compiled.get(o.checkpoint, (None, None))[0]
        compiled = None if entry is None or entry.report is None else entry.memory_bytes
        host = self.per * o.host_bytes
        point = FrontierPoint(
            o.checkpoint,
            int(self._predict(o) or self.per * o.bytes),
            compiled,
            o.total_flops,
            int(host),
            self.time_s(o.total_flops, host),
        )
        if entry is None or compiled is None:
            return point
        return point._replace(flops=entry.flops, time_s=entry.time_s)

    def _mix_point(self, c, n: int, heavy: Option, light: Option, predicted: Real):
        rest = self.per - n
        flops = self.flops_none + n * heavy.flops + rest * light.flops
        host = n * heavy.host_bytes + rest * light.host_bytes
        return FrontierPoint(
            c,
            int(predicted),
            None,
            int(round(flops)),
            int(host),
            self.time_s(flops, host),
        )

    def _price_schedules(self) -> list[FrontierPoint]:
        """The whole-stack schedules of `DEFAULT_CANDIDATES` that make sense
        for the stacks' depth, with their FLOPs counted (exactly)."""
        depth = min(self.depths)
        out = []
        for c in DEFAULT_CANDIDATES:
            if not isinstance(c, Schedule) or not _useful(c, depth):
                continue
            flops = self._cached(
                ("flops", c),
                lambda c=c: int(count_flops(self.fn, *set_checkpoint(self.args, c))),
            )
            out.append(FrontierPoint(c, 0, None, flops, 0, self.time_s(flops, 0)))
        return sorted(out, key=lambda p: p.time_s)

    def _try_schedules(self, pick, schedules) -> FrontierPoint | None:
        """The cheapest schedule that costs less than `pick` and fits, else
        `pick`: compiled cheapest first, until one fits."""
        cheaper = [s for s in schedules if pick is None or s.time_s < pick.time_s]
        reports = [e.report for e, _ in self.compiled.values() if e.report]
        if (
            reports
            and self.budget < reports[0].argument_bytes + reports[0].output_bytes
        ):
            return pick  # every checkpoint needs the arguments and outputs
        if cheaper:
            self.say(f"{len(cheaper)} whole-stack schedules may cost less")
        for s in cheaper:
            floor = self._floor(s.checkpoint)
            if floor > self.budget:
                self.say(
                    f"not compiled: {_name(s.checkpoint)} needs at least "
                    f"{format_bytes(int(floor))}"
                )
                continue
            entry = self.measure(s.checkpoint)
            if entry.fits:
                return s._replace(
                    predicted_bytes=entry.memory_bytes,
                    compiled_bytes=entry.memory_bytes,
                )
        return pick

    def _floor(self, c: Schedule) -> float:
        """Less memory than schedule `c` can need (0 where unknown): the least
        base memory of a compiled uniform option, the carries `c` stores, and
        the residuals of all but one of the layers it holds at once (the last
        one's may be freed while it is reversed)."""
        kept = c.kept(self.per)
        bases = [
            b
            for k, o in self.priced.items()
            if k in self.compiled and self.compiled[k][0].report is not None
            for b in [self._base(o)]
            if b is not None
        ]
        if kept is None or len(self.depths) > 1 or not bases:
            return 0.0
        carries, layers = kept
        nothing = self.priced["nothing"]
        inner = self.priced.get(c.policy, nothing)
        return min(bases) + carries * nothing.bytes + (layers - 1) * inner.bytes

    def _cheapest_compiled(self, pick: FrontierPoint, options) -> FrontierPoint:
        """`pick` costed from its compiled, exact FLOP count; or, if a compiled
        uniform option or schedule that fits costs less, that one (the
        pricing by tracing was wrong somewhere: say so). Uniform options priced
        below the pick's exact cost and predicted to fit are compiled first
        (none are unless the pick's price was wrong)."""
        entry = self.compiled[pick.checkpoint][0]
        pick = pick._replace(flops=entry.flops, time_s=entry.time_s)
        for o in options:
            predicted = self._predict(o)
            if (
                o.checkpoint not in self.compiled
                and self._uniform_point(o).time_s < pick.time_s
                and predicted is not None
                and predicted <= self.budget
            ):
                self.measure(o.checkpoint, predicted)
        fitting = [
            (e.time_s, e.flops, e.memory_bytes or 0, i, c)
            for i, (c, (e, _)) in enumerate(self.compiled.items())
            if e.fits and (c in self.priced or isinstance(c, Schedule))
        ]
        if not fitting or min(fitting)[0] >= pick.time_s:
            return pick
        c = min(fitting)[-1]
        e = self.compiled[c][0]
        self.note(
            f"{_name(pick.checkpoint)} compiled to {format_flops(pick.flops)} "
            f"FLOPs (est. {_format_time(pick.time_s)}): {_name(c)}, compiled and "
            f"fitting, costs less ({_format_time(e.time_s)}); choosing it"
        )
        memory = e.memory_bytes or 0  # `fits`: compiled, so measured
        host = e.report.host_temp_bytes if e.report is not None else 0
        return FrontierPoint(c, memory, memory, e.flops, host, e.time_s)

    def _compiled_points(self) -> list[FrontierPoint]:
        """Compiled schedules and mixes (the uniform options are priced)."""
        out = []
        for c, (entry, predicted) in self.compiled.items():
            if entry.report is None or c in self.priced:
                continue
            host = entry.report.host_temp_bytes
            memory = entry.report.total_bytes
            out.append(
                FrontierPoint(
                    c,
                    int(memory if predicted is None else predicted),
                    memory,
                    entry.flops,
                    host,
                    self.time_s(entry.flops, host),
                )
            )
        return out

    def _target(self) -> str:
        return self.target or self.hw.kind

    def _result(self, chosen, table, frontier) -> PlanResult:
        name = _target_name(list(table) + [chosen], self.target)
        seconds = self.say.elapsed()
        self.say(
            f"done: checkpoint={_name(chosen.checkpoint)}, "
            f"{_format_memory(chosen)}, {self.compiles} compiles, {seconds:.1f} s"
        )
        return PlanResult(
            chosen.checkpoint,
            chosen,
            tuple(table),
            self.budget,
            name,
            tuple(frontier),
            tuple(self.notes),
            self.compiles,
            seconds,
        )


def _line(n: np.ndarray, at: dict[int, float]) -> np.ndarray:
    """The values `at` (count: value) at the counts `n`: joined by straight
    lines between the counts, and beyond them extended from the nearest
    along the least-squares slope of all of them (a constant for one count:
    XLA's memory is not monotone in the count, and the slope of the two
    nearest can be anything)."""
    ns = sorted(at)
    values = [at[k] for k in ns]
    out = np.interp(n, ns, values)
    if len(ns) > 1:
        slope = float(np.polyfit(ns, values, 1)[0])
        out = np.where(n < ns[0], values[0] + (n - ns[0]) * slope, out)
        out = np.where(n > ns[-1], values[-1] + (n - ns[-1]) * slope, out)
    return np.asarray(out)


def _useful(c: Schedule, depth: int) -> bool:
    """Whether schedule `c` differs from a cheaper one at this depth."""
    if isinstance(c, every):
        return c.k < depth
    if isinstance(c, binomial):
        return c.slots < depth
    if isinstance(c, nested):
        return 2**c.levels <= depth
    return depth > 2


def _pareto(points: Sequence[FrontierPoint]) -> list[FrontierPoint]:
    """The points that no other point beats in both memory and time, least
    memory first (compiled memory where there is one)."""

    def memory(p):
        return p.predicted_bytes if p.compiled_bytes is None else p.compiled_bytes

    out: list[FrontierPoint] = []
    for p in sorted(points, key=lambda p: (memory(p), p.time_s)):
        if not out or p.time_s < out[-1].time_s:
            if out and memory(out[-1]) == memory(p):
                out.pop()
            out.append(p)
    return out


def _raise_nothing_fits(
    table: Sequence[PlanEntry], budget: int, target: str
) -> NoReturn:
    measured = [e for e in table if e.report is not None]
    if not measured:
        raise ValueError(
            f"No candidate fits in budget_bytes={format_bytes(budget)} "
            f"[{target}]: XLA refused to compile every one of them "
            "(RESOURCE_EXHAUSTED: larger than one device's memory).\n"
            + _table(table, None)
        )
    best = min(measured, key=lambda e: e.memory_bytes or 0)
    smallest = best.memory_bytes or 0  # compiled: never None
    raise ValueError(
        f"No candidate fits in budget_bytes={format_bytes(budget)} "
        f"[{target}]. The smallest achievable memory is "
        f"{format_bytes(smallest)} ({smallest} bytes), with "
        f"checkpoint={_name(best.checkpoint)}.\n" + _table(table, None)
    )


def _target_name(table: Sequence[PlanEntry], target: str | None) -> str:
    for e in table:
        if e.report is not None:
            return e.report.target
    return jax.default_backend() if target is None else str(target)


def _name(c: Checkpoint) -> str:
    return repr(c) if c is None or isinstance(c, str) else str(c)


def _table(table: Sequence[PlanEntry], chosen: PlanEntry | None) -> str:
    base = min(e.flops for e in table) or 1
    rows = [("", "checkpoint", "memory", "FLOPs", "vs fewest", "est. time", "fits")]
    for e in table:
        rows.append(
            (
                "*" if e is chosen else "",
                _name(e.checkpoint),
                _format_memory(e),
                format_flops(e.flops),
                f"{e.flops / base:.2f}x",
                _format_time(e.time_s),
                "yes" if e.fits else "no",
            )
        )
    return _columns(rows)


def _frontier_table(points: Sequence[FrontierPoint], chosen: Checkpoint) -> str:
    rows = [("", "checkpoint", "predicted", "compiled", "FLOPs", "host", "est. time")]
    for p in points:
        rows.append(
            (
                "*" if p.checkpoint == chosen else "",
                _name(p.checkpoint),
                format_bytes(p.predicted_bytes),
                "-" if p.compiled_bytes is None else format_bytes(p.compiled_bytes),
                format_flops(p.flops),
                format_bytes(p.host_bytes) if p.host_bytes else "-",
                _format_time(p.time_s),
            )
        )
    return _columns(rows)


def _columns(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows
    )


def _format_time(seconds: float) -> str:
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def _format_memory(e: PlanEntry) -> str:
    if e.memory_bytes is None:
        return "too large (XLA)"
    if e.report is not None:
        return format_bytes(e.memory_bytes)
    return f">= {format_bytes(e.memory_bytes)} (XLA)"

"""The memory-budget planner: the checkpoint that fits a budget and runs a step
fastest, by the clock where the device is at hand.

The planner is stages over values (the algorithm is told once, in the tutorial
*Fit a model in a budget*); `_Planner`, here, runs them for one call:

1. price: trace the function once per per-layer option (`Prices`, here,
   frozen, cached per function, argument shapes and target);
2. confirm: compile what the choice depends on (`_compiled.Compiled`, one
   typed record per program) and, on the device at hand, run it (`_clock`'s
   measured `Timing`s);
3. choose: the cheapest mix of two options predicted to fit
   (`_solve.best_mix`, pure), from the memory the compiles taught and the
   times the clock (or the roofline) gives;
4. report: a `_report.PlanResult`, whose entries' `fits` are derived from the
   budget the plan ended with.

What a call learns is kept for the next in `_cache.CACHE`.
"""

import dataclasses
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._inspect._flops import count_flops
from .._inspect._memory import ReplicatedArgumentsWarning, _v5e, traced_for
from .._policies._values import save_names
from .._schedules._binomial import binomial
from .._schedules._checkpoint import Checkpoint, map_checkpoints, set_checkpoint
from .._schedules._engine import Schedule
from .._schedules._ranges import ranges
from .._schedules._uniform import every, nested, recursive
from .._util import format_bytes, format_flops, split_args
from . import _cache
from ._cache import _key
from ._clock import (
    Timing,
    concrete,
    contenders,
    device_memory_bytes,
    on_one_clock,
    time_interleaved,
    warm_up,
)
from ._compiled import Compiled, _Program, compile_checkpoint
from ._hardware import hardware
from ._report import (
    FrontierPoint,
    PlanEntry,
    PlanResult,
    _bytes,
    _format_memory,
    _format_time,
    _name,
    _raise_nothing_fits,
)
from ._solve import (
    Mix,
    Option,
    Predict,
    Real,
    best_mix,
    linear,
    lower_hull,
    per_layer_options,
    prefix_options,
    price,
    roofline_time,
    share_per_chip,
    stack_depths,
)


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


# A call compiles at most this many mixes that do not fit, then chooses among
# uniform options (each compile of a large model on TPU v5e takes minutes).
_MIX_TRIES = 6
# How far above the budget the model may put a uniform option that fits when
# compiled, at least: options whose per-layer bytes are equal, or nearly, can
# differ by a few percent once XLA assigns their buffers.
_MODEL_ERROR = 0.05


@dataclasses.dataclass(frozen=True)
class Prices:
    """What tracing the function told (stage 1): its stacks, and each
    per-layer option priced per layer and per chip.

    - `depths`: the depth of each differentiated stack, in the order it runs.
    - `per`: the depth all stacks share (mixes are of that many layers), or 1
      where stacks of different depths cannot be mixed.
    - `share`: the part of the activations one chip holds.
    - `options`: the per-layer options ([`Option`][]s, time by the roofline).
    - `tags`: the model's `checkpoint_name` tags.
    - `flops_none`: the function's FLOPs without checkpointing.
    - `schedules`: the whole-stack schedules worth comparing, with their FLOPs.
    """

    depths: tuple[int, ...]
    per: int
    share: float
    options: tuple[Option, ...]
    tags: tuple[str, ...]
    flops_none: int
    schedules: tuple[tuple[Schedule, int], ...]

    def option(self, c: Checkpoint) -> Option | None:
        for o in self.options:
            if o.checkpoint == c:
                return o
        return None


class _Progress:
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


class _Planner:
    """One call of `plan`: its inputs, the records of what it compiled and
    timed, and what to tell the user. Every attribute is set here; the
    stages are methods that read and add to the records."""

    def __init__(
        self,
        fn,
        args,
        budget: int,
        target,
        measure: bool,
        say: _Progress,
        solving: bool,
    ):
        self.fn, self.args, self.target, self.say = fn, args, target, say
        self.measure = measure
        self.hw, known = hardware(target)
        chips = 1
        if target is not None:
            chips = _v5e(target)[1].size
        self.share = share_per_chip(args, chips)
        self.key = _key(fn, args, target)
        self.notes: list[str] = []
        # This call's records: what it compiled (or took from the cache), the
        # memory it predicted for each, and the step times measured.
        self.compiled: dict[Checkpoint, Compiled] = {}
        self.predicted: dict[Checkpoint, float | None] = {}
        self.timings: dict[Checkpoint, Timing] = {}
        self.compiles = 0
        # Timing may take as long as this call's own compiles (fresh ones,
        # not those taken from the cache): `fresh_s`, against `timed_s`.
        self.timed_s = 0.0
        self.fresh_s = 0.0
        # Compiled mixes' memory, `ranges((D - n, light), (n, heavy))`: shared
        # by later calls for the same function (what compiling them taught).
        self.mixes: dict[ranges, int] = _cache.CACHE.get(fn, self._k("mixes"), dict)
        # Arrays to run programs on, made once (at the first timing).
        self.inputs: list[Any] = []
        # Where one device holds less than the budget, the budget is that.
        if target is None:
            # The device's limit, not what is free now: the same on every
            # process of a multi-process run.
            capacity = (
                device_memory_bytes(free=False)
                if jax.default_backend() != "cpu"
                else None
            )
        else:
            capacity = self.hw.memory_bytes
        self.budget = budget
        if capacity is not None and budget > capacity:
            self.budget = capacity
            self.note(
                f"the budget, {format_bytes(budget)}, is more than one device "
                f"holds ({format_bytes(capacity)}): planning for that"
            )
        if not known:
            self.note(
                f"this device's figures are unknown; priced as {self.hw.kind} "
                f"({self.hw.source})"
            )
        # Stage 1, when solving: what tracing tells, priced once.
        self.prices: Prices | None = None
        if solving:
            self.prices = _cache.CACHE.get(fn, self._k("prices"), self._price)
        self.per = 1 if self.prices is None else self.prices.per

    def _k(self, *what: Any) -> Any:
        return None if self.key is None else (self.key, *what)

    def note(self, message: str) -> None:
        self.notes.append(message)
        self.say(f"note: {message}")

    # --- compiling and timing ------------------------------------------------

    def compile(self, c: Checkpoint, predicted: Real | None = None) -> Compiled:
        """Compile `c` (or take it from the cache): its record."""
        if c in self.compiled:
            return self.compiled[c]
        key = self._k("compiled", c)
        record: Compiled | None = None
        if _cache.CACHE.has(self.fn, key):
            record = _cache.CACHE.get(self.fn, key, lambda: None)
        # A program compiled by a call that did not measure has no executable:
        # compiled again to be timed.
        fresh = record is None or (
            self.measure and record.report is not None and record.executable is None
        )
        if record is None or fresh:
            record = compile_checkpoint(
                self.fn, self.args, c, self.target, runnable=self.measure
            )
            _cache.CACHE.put(self.fn, key, record)
        self.compiles += fresh
        self.fresh_s += record.compile_s if fresh else 0.0
        self.compiled[c] = record
        self.predicted[c] = None if predicted is None else float(predicted)
        self._on_xla_limit(record)
        what = "does not fit in one chip" if record.report is None else "compiled"
        pred = "" if predicted is None else f" (predicted {_bytes(predicted)})"
        fits = self._fits(record)
        self.say(
            f"{what}: {_name(c)}: {_format_memory(record)}{pred}, "
            f"{'fits' if fits else 'does not fit'}"
            + (f" ({record.compile_s:.1f} s)" if fresh else " (cached)"),
            detail=True,
        )
        return record

    def _on_xla_limit(self, record: Compiled) -> None:
        available = record.available_bytes
        if available is not None and available < self.budget:
            self.note(
                f"the budget, {format_bytes(self.budget)}, is more than one "
                f"device holds: XLA says {format_bytes(available)}; planning "
                "for that"
            )
            self.budget = available

    def _fits(self, record: Compiled) -> bool:
        return record.report is not None and record.report.total_bytes <= self.budget

    def runnable(self, c: Checkpoint) -> bool:
        """Whether `c` was compiled for the device at hand and fits what it
        has free (arguments, outputs and temporaries)."""
        record = self.compiled.get(c)
        if record is None or record.executable is None or record.report is None:
            return False
        free = device_memory_bytes()
        return free is None or record.report.total_bytes <= free

    def left_s(self) -> float:
        """What is left of the time timing may take: this call's fresh
        compiles' time, less what timing took so far."""
        return self.fresh_s - self.timed_s

    def time(self, cs: Sequence[Checkpoint]) -> None:
        """Measure the step time of each of `cs` that can run here and has no
        time yet: round-robin with the fastest program already timed, each
        program's time the ratio of the mean of its faster half of rounds
        to that one's (one clock for the whole plan), after a warm-up run
        each. Rounds of every program (at least two) while they fit in half
        of what is left of this call's compile time, then, as a race, more
        rounds (at most 21 in all) of those no other program beats by
        `RULED_OUT` in both time and memory, while they fit in the rest."""
        new = []
        for c in dict.fromkeys(cs):
            if c in self.timings or not self.runnable(c):
                continue
            key = self._k("time", c)
            if _cache.CACHE.has(self.fn, key):
                self.timings[c] = _cache.CACHE.get(self.fn, key, lambda: None)
            else:
                new.append(c)
        if not new:
            return
        timed = [c for c in self.timings if self.runnable(c)]
        reference = min(timed, key=lambda c: self.timings[c].seconds) if timed else None
        run = new + ([reference] if reference is not None else [])
        programs = [self._program(c) for c in run]
        memory = [self.compiled[c].memory_bytes or 0 for c in run]
        pivot = len(run) - 1 if reference is not None else None
        start = time.perf_counter()
        warm = warm_up(programs)
        timings = time_interleaved(
            programs,
            rounds=21,
            warmup=False,
            seconds=self.left_s() - warm,
            keep=lambda ts: contenders(ts, memory, always=pivot),
        )
        took = time.perf_counter() - start
        self.timed_s += took
        most = max(t.rounds for t in timings)
        if reference is not None:  # on the clock of the plan's earlier rounds
            timings = on_one_clock(
                timings, -1, self.timings[reference].seconds, by="faster_half"
            )
        else:  # on the clock of the fastest program that ran every round
            raced = [i for i, t in enumerate(timings) if t.rounds == most]
            fastest = min(raced, key=lambda i: timings[i].faster_half)
            timings = on_one_clock(timings, fastest, by="faster_half")
        for c, t in zip(new, timings):
            self.timings[c] = t
            if self.key is not None:
                _cache.CACHE.get(self.fn, self._k("time", c), lambda t=t: t)
        ran_all = sum(t.rounds == most for t in timings[: len(new)])
        least = min(t.rounds for t in timings[: len(new)])
        rounds = f"{most}" if least == most else f"{least} to {most}"
        self.say(
            f"timed {len(new)} program(s): {rounds} interleaved round(s) after a "
            f"warm-up ({most} for {ran_all} not ruled out), {took:.1f} s; "
            f"{self._spent()}",
            detail=len(new) < 3,
        )

    def _spent(self) -> str:
        """How long timing took against this call's compiles: the bound."""
        over = " (over: the fewest rounds take longer)" if self.left_s() < 0 else ""
        return (
            f"timing {self.timed_s:.1f} s in all, for {self.fresh_s:.1f} s of "
            f"this call's compiles{over}"
        )

    def _program(self, c: Checkpoint) -> _Program:
        if not self.inputs:  # made once, at the first program run
            self.inputs.extend(jax.tree.leaves(concrete(split_args(self.args)[0])))
        dynamic = split_args(set_checkpoint(self.args, c))[0]
        inputs = jax.tree.unflatten(jax.tree.structure(dynamic), self.inputs)
        return _Program(self.compiled[c], inputs)

    def time_s(self, c: Checkpoint, estimate: float) -> tuple[float, bool]:
        """`(seconds, measured)`: `c`'s measured step time, else `estimate`."""
        if c in self.timings:
            return self.timings[c].seconds, True
        return estimate, False

    def entry(self, record: Compiled, estimate: float) -> PlanEntry:
        """The entry of a compiled program, `fits` against the budget now."""
        seconds, measured = self.time_s(record.checkpoint, estimate)
        return PlanEntry(
            record.checkpoint,
            record.memory_bytes,
            record.flops,
            self._fits(record),
            record.report,
            record.error,
            seconds,
            measured,
        )

    def scale(self) -> float:
        """Measured over roofline time, the median over the timed per-layer
        options (1 where none was timed): how this device's clock differs
        from the roofline, so that estimates sit beside measurements."""
        ratios = [
            t.seconds / (o.time * self.per)
            for o in (self.prices.options if self.prices else ())
            for t in [self.timings.get(o.checkpoint)]
            if t is not None and o.time > 0
        ]
        return statistics.median(ratios) if ratios else 1.0

    def estimate(self, flops: Real, moved: Real = 0, host: Real = 0) -> float:
        """The roofline's step time on one chip for the whole function's
        `flops`, bytes `moved` through device memory and bytes offloaded to
        the `host` (all chips together), scaled to the clock (`scale`)."""
        s = self.share
        return self.scale() * roofline_time(self.hw, s * flops, s * moved, s * host)

    # --- stage 1: prices ------------------------------------------------------

    def _price(self) -> Prices:
        """Trace the function: its stacks, then each per-layer option."""
        self.say("tracing the function to find its stacks")
        depths = tuple(stack_depths(self.fn, self.args))
        if not depths:
            raise ValueError(
                "plan expected fn to differentiate the stacks of the modules in "
                "its arguments (pass a gradient or training step, e.g. "
                "eqx.filter_grad(loss)). Got a function whose backward pass runs "
                "no checkpointed stack."
            )
        per = depths[0] if len(set(depths)) == 1 else 1
        kinds = frozenset(depths)
        raw: dict[Checkpoint, tuple[int, int, int, int]] = {}

        def priced(c: Checkpoint) -> tuple[int, int, int, int]:
            start = time.perf_counter()
            device, host, flops, moved, names = price(self.fn, self.args, c, kinds)
            raw[c] = device, host, flops, moved
            self.say(
                f"priced {_name(c)}: {_bytes(self.share * device / per)}/layer"
                + (f" + {_bytes(self.share * host / per)} on the host" if host else "")
                + f", {format_flops(flops)} FLOPs, {_bytes(moved)} moved "
                f"({time.perf_counter() - start:.1f} s)",
                detail=True,
            )
            tags.extend(t for t in names if t not in tags)
            return raw[c]

        tags: list[str] = []
        priced(None)
        host_link = self.hw.host_bytes_per_s is not None
        rest = per_layer_options(tags, host_link)[1:]
        for c in rest:
            priced(c)
        nothing = raw["nothing"]
        singles = [
            (t, raw[save_names(t)][0] - nothing[0], nothing[2] - raw[save_names(t)][2])
            for t in tags
        ]
        more = prefix_options(singles, host_link) if len(tags) > 1 else []
        for c in more:
            priced(c)
        flops_none = raw[None][2]

        def option(c: Checkpoint) -> Option:
            device, host, flops, moved = raw[c]
            s = self.share
            return Option(
                c,
                s * device / per,
                s * host / per,
                (flops - flops_none) / per,
                roofline_time(self.hw, s * flops, s * moved, s * host) / per,
                flops,
            )

        schedules = []
        for c in DEFAULT_CANDIDATES:
            if isinstance(c, Schedule) and _useful(c, min(depths)):
                flops = count_flops(self.fn, *set_checkpoint(self.args, c))
                schedules.append((c, int(flops)))
        return Prices(
            depths,
            per,
            self.share,
            tuple(option(c) for c in raw),
            tuple(tags),
            flops_none,
            tuple(schedules),
        )

    # --- stages 2 and 3: confirm and choose ----------------------------------

    def options(self) -> list[Option]:
        """The per-layer options, each with its time per layer: measured
        (its step time over the depth) where it ran, else the roofline's,
        scaled to the clock."""
        assert self.prices is not None
        scale = self.scale()
        out = []
        for o in self.prices.options:
            t = self.timings.get(o.checkpoint)
            time_per = o.time * scale if t is None else t.seconds / self.per
            out.append(o._replace(time=time_per))
        return out

    def solve(self) -> PlanResult:
        prices = self.prices
        assert prices is not None
        if len(set(prices.depths)) > 1:
            self.note(
                f"stacks of different depths ({', '.join(map(str, prices.depths))}) "
                "cannot share layer ranges: comparing uniform options only"
            )
        self.say(
            f"{len(prices.depths)} stack(s) of {'/'.join(map(str, prices.depths))} "
            f"layers; {len(prices.options)} per-layer options; tags: "
            f"{', '.join(prices.tags) or 'none'}"
        )
        link = self.hw.host_bytes_per_s
        self.say(
            f"{'timing on' if self.measure else 'estimating for'} {self._target()}: "
            f"{self.hw.peak_flops / 1e12:.3g} TFLOP/s, "
            f"{self.hw.memory_bytes_per_s / 1e9:.3g} GB/s"
            + ("" if link is None else f", host link {link / 1e9:g} GB/s")
            + " per chip"
        )
        if self.measure:
            # Every option that can fit the device is compiled and run: the
            # clock, not a model, ranks them.
            for o in prices.options:
                self.compile(o.checkpoint, self._predict(o))
            self.time([o.checkpoint for o in prices.options])
        pick = self._choose()
        if pick is not None:
            pick = self._cheapest_compiled(pick)
        pick = self._try_schedules(pick)
        if pick is None:
            self._compile_lightest_schedules()
            _raise_nothing_fits(
                [self.entry(r, self.roofline(c)) for c, r in self.compiled.items()],
                self.budget,
                self._target_name(),
            )
        if self.measure:
            pick = self._race(pick)
        hull = lower_hull(self.options())
        self.say(
            "lower convex hull: " + ", ".join(_name(o.checkpoint) for o in hull),
            detail=True,
        )
        points = [self._uniform_point(o) for o in hull] + self._compiled_points()
        record = self.compiled[pick.checkpoint]
        entry = self.entry(record, pick.time_s)
        return self._result(entry, (), _pareto(points + [pick]))

    def _base(self, o: Option) -> float | None:
        """Memory besides the stack's saved values, learnt from compiled uniform
        options: exact for a compiled one (from XLA's figure, a lower bound,
        for one XLA refused; infinite where it gave none), interpolated in
        bytes between compiled ones otherwise. `None` before any compile."""
        assert self.prices is not None
        known = []
        for c, record in self.compiled.items():
            v = self.prices.option(c)
            if v is None or (record.report is None and c != o.checkpoint):
                continue
            memory = record.memory_bytes
            memory = math.inf if memory is None else memory
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
        mixes (this call's and earlier calls' for the same function) taught:
        where mixes of the same two options were compiled, the model's error
        interpolated over their counts (see `_line`); for another pair with
        the same heavy option, its largest error there; for any other pair,
        the largest excess of any compiled mix over the model (none if no mix
        needed more)."""
        assert self.prices is not None
        by = {o.checkpoint: o for o in self.prices.options}
        bases = {c: self._base(o) or 0.0 for c, o in by.items()}
        model = linear(lambda o: bases[o.checkpoint], self.per)
        errors: dict[tuple, dict[int, float]] = {}  # (light, heavy): {n: error}
        for c, memory in self.mixes.items():
            (_, light), (n, heavy) = c.parts
            if light in by and heavy in by:
                error = memory - float(model(by[light], by[heavy], np.array(n)))
                errors.setdefault((light, heavy), {})[n] = error
        by_heavy: dict[Checkpoint, float] = {}
        for (_, heavy), at in errors.items():
            by_heavy[heavy] = max(by_heavy.get(heavy, -math.inf), *at.values())
        margin = max([0.0, *by_heavy.values()])

        exact = {
            c: r.report.total_bytes
            for c, r in self.compiled.items()
            if r.report is not None and c in by
        }

        def predict(light: Option, heavy: Option, n: np.ndarray) -> np.ndarray:
            memory = model(light, heavy, n)
            if light.checkpoint == heavy.checkpoint:
                if light.checkpoint in exact:  # compiled: no rounding either way
                    return np.full(np.shape(n), float(exact[light.checkpoint]))
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
        return None if base is None else max(base + self.per * o.bytes, 0.0)

    def _choose(self) -> FrontierPoint | None:
        """The cheapest mix predicted to fit, confirmed by compiling: solve,
        compile what the answer depends on (its options, uniform, for their
        base memory; then the mix itself), solve again with what that taught,
        until the answer compiled fits."""
        assert self.prices is not None
        options = self.options()
        hull = lower_hull(options)
        for o in (hull[-1], hull[0]):  # the cheapest and the lightest
            self.compile(o.checkpoint, self._predict(o))
        mixable = self.per > 1
        limits: dict[tuple, int] = {}
        most = self.per if mixable else 0
        failed = 0
        for _ in range(4 * len(options) + 8):
            if most and failed == _MIX_TRIES:
                most = 0
                self.note(
                    f"{failed} mixes did not fit when compiled: XLA's memory is "
                    "not the model's here; choosing among uniform options"
                )
            options = self.options()
            best = best_mix(
                options,
                self._predictor(),
                self.per,
                self.budget,
                lambda light, heavy: min(
                    limits.get((light.checkpoint, heavy.checkpoint), most), most
                ),
            )
            if best is None:
                # Before saying that nothing fits: what may fit, by as much
                # as the model was off.
                near = self._may_fit(options, self._model_error())
                if not near:
                    return None
                o, predicted = near[0]
                self.compile(o.checkpoint, predicted)
                continue
            ends = (best.light,) if best.n == 0 else (best.light, best.heavy)
            new = [o for o in ends if o.checkpoint not in self.compiled]
            for o in new:
                self.compile(o.checkpoint, self._predict(o))
            if new:
                continue
            if best.n == 0:
                return self._uniform_point(best.light)
            point, fewer = self._try_mix(best)
            if point is not None:
                return point
            limits[(best.light.checkpoint, best.heavy.checkpoint)] = fewer
            failed += 1
        raise AssertionError("plan: the search for a mix did not settle")

    def _may_fit(
        self, options: Sequence[Option], error: float
    ) -> list[tuple[Option, float]]:
        """The uniform options not compiled yet that may fit, lightest first,
        each with its predicted memory: at most the budget plus a relative
        `error`."""
        near = []
        for o in options:
            predicted = self._predict(o)
            if o.checkpoint in self.compiled or predicted is None:
                continue
            if predicted <= self.budget * (1 + error):
                near.append((o, predicted))
        return sorted(near, key=lambda p: p[1])

    def _model_error(self) -> float:
        """How far off the model's memory may be: the most it was off for a
        uniform option this call compiled, and at least `_MODEL_ERROR`."""
        assert self.prices is not None
        errors = [
            abs(r.report.total_bytes - p) / r.report.total_bytes
            for c, r in self.compiled.items()
            if (p := self.predicted.get(c)) is not None
            and r.report is not None
            and self.prices.option(c) is not None
        ]
        return max([_MODEL_ERROR, *errors])

    def _try_mix(self, best: Mix) -> tuple[FrontierPoint | None, int]:
        """Compile the mix `best`: `(its point, n)` if it fits, else `(None,
        the most heavy layers worth trying next)`, stepping by as many layers
        as the compiled excess says."""
        light, heavy, n = best.light, best.heavy, best.n
        c = ranges((self.per - n, light.checkpoint), (n, heavy.checkpoint))
        point = self._mix_point(c, best)
        record = self.compile(c, point.predicted_bytes)
        if record.report is not None:
            self.mixes[c] = record.report.total_bytes
        if self._fits(record):
            return point._replace(compiled_bytes=record.memory_bytes), n
        excess = (record.memory_bytes or self.budget + 1) - self.budget
        step = max(1, math.ceil(excess / max(heavy.bytes - light.bytes, 1)))
        fewer = max(n - step, 0)
        self.note(
            f"{_name(c)} was predicted to fit ({_bytes(point.predicted_bytes)}) "
            f"but compiled to {_format_memory(record)}: at most {fewer} layers "
            f"of {_name(heavy.checkpoint)} with {_name(light.checkpoint)}"
        )
        return None, fewer

    def _uniform_point(self, o: Option) -> FrontierPoint:
        record = self.compiled.get(o.checkpoint)
        compiled = None if record is None else record.report and record.memory_bytes
        estimate = o.time * self.per
        seconds, measured = self.time_s(o.checkpoint, estimate)
        host = self.per * o.host_bytes
        flops = o.total_flops if record is None else record.flops
        return FrontierPoint(
            o.checkpoint,
            int(self._predict(o) or self.per * o.bytes),
            compiled,
            int(flops),
            int(host),
            seconds,
            measured,
        )

    def _mix_point(self, c: ranges, best: Mix) -> FrontierPoint:
        assert self.prices is not None
        light, heavy, n = best.light, best.heavy, best.n
        rest = self.per - n
        flops = self.prices.flops_none + n * heavy.flops + rest * light.flops
        host = n * heavy.host_bytes + rest * light.host_bytes
        return FrontierPoint(
            c,
            int(best.predicted),
            None,
            int(round(flops)),
            int(host),
            n * heavy.time + rest * light.time,
        )

    def _schedule_time(self, c: Checkpoint, flops: int) -> float:
        """A schedule's estimated step time: where its inner policy (or
        `"nothing"`) was timed, that time scaled by the FLOPs (a schedule
        recomputes what its inner policy would, more often); else, and for a
        checkpoint that is not a schedule, the roofline's (`roofline`)."""
        if not isinstance(c, Schedule):
            return self.roofline(c)
        inner = c.policy if c.policy is not None else "nothing"
        t = self.timings.get(inner)
        record = self.compiled.get(inner)
        if t is not None and record is not None and record.flops > 0:
            return t.seconds * flops / record.flops
        return self.roofline(c)

    def roofline(self, c: Checkpoint) -> float:
        """The roofline's step time of `c` on every layer, scaled to the clock:
        a per-layer option's price, else `c` priced by tracing (once: the
        cache keeps it), its FLOPs, bytes moved and offloaded bytes alike.
        A `ranges` mix is its parts' times per layer, weighted by their
        layers."""
        if isinstance(c, ranges):
            depth = sum(n for n, _ in c.parts)
            return sum(n * self.roofline(part) for n, part in c.parts) / depth
        o = None if self.prices is None else self.prices.option(c)
        if o is not None:
            return self.scale() * o.time * self.per
        depths = _cache.CACHE.get(
            self.fn,
            self._k("depths"),
            lambda: frozenset(stack_depths(self.fn, self.args)),
        )
        device, host, flops, moved, _ = _cache.CACHE.get(
            self.fn,
            self._k("price", c),
            lambda: price(self.fn, self.args, c, depths),
        )
        return self.estimate(flops, moved, host)

    def _try_schedules(self, pick: FrontierPoint | None) -> FrontierPoint | None:
        """The fastest schedule that is faster than `pick` and fits, else
        `pick`: compiled (and timed) fastest first, until one fits and, timed,
        still beats `pick`."""
        assert self.prices is not None
        reports = [r.report for r in self.compiled.values() if r.report is not None]
        if (
            reports
            and self.budget < reports[0].argument_bytes + reports[0].output_bytes
        ):
            return pick  # every checkpoint needs the arguments and outputs
        estimates = sorted(
            (self._schedule_time(c, flops), i, c, flops)
            for i, (c, flops) in enumerate(self.prices.schedules)
        )
        cheaper = [e for e in estimates if pick is None or e[0] < pick.time_s]
        if cheaper:
            self.say(
                f"{len(cheaper)} whole-stack schedule(s) may be faster", detail=True
            )
        for estimate, _, c, flops in cheaper:
            floor = self._floor(c)
            if floor > self.budget:
                self.say(
                    f"not compiled: {_name(c)} needs at least {_bytes(floor)}",
                    detail=True,
                )
                continue
            record = self.compile(c)
            if not self._fits(record):
                continue
            self.time([c])
            seconds, measured = self.time_s(c, estimate)
            if pick is not None and seconds >= pick.time_s:
                continue
            memory = record.memory_bytes or 0
            return FrontierPoint(
                c, memory, memory, record.flops, record.host_bytes, seconds, measured
            )
        return pick

    def _compile_lightest_schedules(self) -> None:
        """Before saying that nothing fits: compile the schedules whose floor
        is below the least memory compiled, so that the error names the
        smallest memory there is."""
        assert self.prices is not None
        least = min(
            (r.report.total_bytes for r in self.compiled.values() if r.report),
            default=None,
        )
        for c, _ in self.prices.schedules:
            if least is None or self._floor(c) < least:
                self.compile(c)

    def _floor(self, c: Schedule) -> float:
        """Less memory than schedule `c` can need (0 where unknown): the least
        base memory of a compiled uniform option, the carries `c` stores, and
        the residuals of all but one of the layers it holds at once (the last
        one's may be freed while it is reversed)."""
        assert self.prices is not None
        kept = c.kept(self.per)
        bases = [
            b
            for o in self.prices.options
            if o.checkpoint in self.compiled
            and self.compiled[o.checkpoint].report is not None
            for b in [self._base(o)]
            if b is not None
        ]
        if kept is None or len(set(self.prices.depths)) > 1 or not bases:
            return 0.0
        carries, layers = kept
        nothing = self.prices.option("nothing")
        inner = self.prices.option(c.policy) or nothing
        assert nothing is not None and inner is not None
        return min(bases) + carries * nothing.bytes + (layers - 1) * inner.bytes

    def _cheapest_compiled(self, pick: FrontierPoint) -> FrontierPoint:
        """`pick` timed from its compiled record; or, if a compiled uniform
        option or schedule that fits is faster, or a mix that fits and was
        timed (by an earlier call's race), that one (say so). Options
        estimated faster than the pick and predicted to fit, or just over
        the budget, are compiled (and timed) first: a prediction within a few
        percent of the budget can be wrong either way."""
        assert self.prices is not None
        record = self.compiled[pick.checkpoint]
        seconds, measured = self.time_s(pick.checkpoint, pick.time_s)
        pick = pick._replace(flops=record.flops, time_s=seconds, measured=measured)
        for o, predicted in self._may_fit(self.options(), _MODEL_ERROR):
            if o.time * self.per < pick.time_s:
                self.compile(o.checkpoint, predicted)
        # The mixes earlier calls raced: their records and times are cached.
        raced = [
            c
            for c in self.mixes
            if _cache.CACHE.has(self.fn, self._k("time", c))
            and _cache.CACHE.has(self.fn, self._k("compiled", c))
        ]
        for c in raced:
            self.compile(c)
        # The uniform options and schedules; a mix is timed by the race.
        self.time([c for c in self.compiled if not isinstance(c, ranges) or c in raced])
        seconds, measured = self.time_s(pick.checkpoint, pick.time_s)
        pick = pick._replace(time_s=seconds, measured=measured)
        fitting = []
        for i, (c, r) in enumerate(self.compiled.items()):
            if not self._fits(r) or (isinstance(c, ranges) and c not in self.timings):
                continue
            if c == pick.checkpoint:
                continue
            o = self.prices.option(c)
            estimate = (
                o.time * self.per if o is not None else self._schedule_time(c, r.flops)
            )
            seconds, measured = self.time_s(c, estimate)
            fitting.append((seconds, r.flops, r.memory_bytes or 0, i, c, measured))
        if not fitting or min(fitting)[0] >= pick.time_s:
            return pick
        seconds, flops, memory, _, c, measured = min(fitting)
        self.note(
            f"{_name(pick.checkpoint)} takes {_format_time(pick.time_s)} a step: "
            f"{_name(c)}, compiled and fitting, is faster "
            f"({_format_time(seconds)}); choosing it"
        )
        return FrontierPoint(
            c, memory, memory, flops, self.compiled[c].host_bytes, seconds, measured
        )

    def _race(self, pick: FrontierPoint) -> FrontierPoint:
        """`pick` against its rivals, the options that fit, are not a mix and
        were timed within 3% of the fastest of them: the fastest (say so where it
        is not the pick). Timings that close are within the noise of the
        rounds that ranked them, so where what is left of this call's
        compile time covers a warm-up and two rounds, the pick and as many
        rivals as it covers (at most three) are run round-robin again (once
        per plan cache); otherwise the plan's own rounds decide. A pick not
        timed yet (a mix) is always run, with one rival at least: it is
        measured before it is returned."""
        if not self.runnable(pick.checkpoint):
            return pick
        measured = pick.checkpoint in self.timings
        fitting = [
            c
            for c, r in self.compiled.items()
            if self._fits(r)
            and not isinstance(c, ranges)
            and c in self.timings
            and self.runnable(c)
        ]
        fitting.sort(key=lambda c: self.timings[c].seconds)
        bar = 1.03 * self.timings[fitting[0]].seconds if fitting else 0.0
        rivals = [
            c
            for c in fitting
            if self.timings[c].seconds <= bar and c != pick.checkpoint
        ][:3]
        if not rivals:
            if not measured:  # nothing to race: timed beside the plan's clock
                self.time([pick.checkpoint])
            seconds, measured = self.time_s(pick.checkpoint, pick.time_s)
            return pick._replace(time_s=seconds, measured=measured)
        step = self.timings[pick.checkpoint].seconds if measured else pick.time_s
        n = 0
        for c in rivals:  # a warm-up and two rounds of each program raced
            step += self.timings[c].seconds
            if 3 * step > self.left_s():
                break
            n += 1
        if not measured:  # it is measured before it is returned
            n = max(n, 1)
        run = [pick.checkpoint, *rivals[: max(n, 1)]]
        key = self._k("race", tuple(run))
        if n or _cache.CACHE.has(self.fn, key):
            timings = _cache.CACHE.get(self.fn, key, lambda: self._time_race(run))
            how = "raced the pick"
            # On the plan's clock: where the race ran more rounds than timed a
            # program before, its time is the race's, for later calls too.
            for c, t in zip(run, timings):
                if c not in self.timings or t.rounds >= self.timings[c].rounds:
                    self.timings[c] = t
                    _cache.CACHE.put(self.fn, self._k("time", c), t)
        else:
            timings = [self.timings[c] for c in run]
            how = "no time left to race the pick (the plan's rounds decide)"
        k = min(range(1, len(run)), key=lambda i: timings[i].seconds)
        best, ratio = run[k], timings[0].seconds / timings[k].seconds
        self.say(
            f"{how}: {ratio:.3f}x the step time of {_name(best)}, the "
            "fastest option that fits and is not a mix"
        )
        if ratio < 1.0:
            self.timings[pick.checkpoint] = timings[0]
            return pick._replace(time_s=timings[0].seconds, measured=True)
        self.note(
            f"{_name(pick.checkpoint)} ran {ratio:.3f}x the step time of "
            f"{_name(best)}, which fits: choosing {_name(best)}"
        )
        r = self.compiled[best]
        memory = r.memory_bytes or 0
        return FrontierPoint(
            best, memory, memory, r.flops, r.host_bytes, timings[k].seconds, True
        )

    def _time_race(self, run: list[Checkpoint]) -> list[Timing]:
        """`run` timed round-robin after a warm-up, on the clock of `run[1]`'s
        earlier timing: 2 to 31 rounds, as many as fit in what is left of
        this call's compile time (the closer the race, the more rounds it
        needs: its rivals are within 3%)."""
        programs = [self._program(c) for c in run]
        start = time.perf_counter()
        warm = warm_up(programs)
        timings = time_interleaved(
            programs, rounds=31, warmup=False, seconds=self.left_s() - warm
        )
        self.timed_s += time.perf_counter() - start
        self.say(
            f"raced {len(run)} programs in {timings[0].rounds} rounds; {self._spent()}"
        )
        return on_one_clock(timings, 1, self.timings[run[1]].seconds, by="faster_half")

    def _compiled_points(self) -> list[FrontierPoint]:
        """Compiled schedules and mixes (the uniform options are priced)."""
        assert self.prices is not None
        out = []
        for c, r in self.compiled.items():
            if r.report is None or self.prices.option(c) is not None:
                continue
            predicted = self.predicted.get(c)
            memory = r.report.total_bytes
            if isinstance(c, ranges):
                (k, light), (n, heavy) = c.parts
                lo, hi = self.prices.option(light), self.prices.option(heavy)
                assert lo is not None and hi is not None
                opts = {o.checkpoint: o for o in self.options()}
                estimate = k * opts[light].time + n * opts[heavy].time
            else:
                estimate = self._schedule_time(c, r.flops)
            seconds, measured = self.time_s(c, estimate)
            out.append(
                FrontierPoint(
                    c,
                    int(memory if predicted is None else predicted),
                    memory,
                    r.flops,
                    r.host_bytes,
                    seconds,
                    measured,
                )
            )
        return out

    # --- enumerating candidates ----------------------------------------------

    def enumerate(self, candidates: Sequence[Checkpoint]) -> PlanResult:
        self.say(f"compiling {len(candidates)} candidates for {self._target()}")
        records = [self.compile(c) for c in candidates]
        self.time(candidates)
        table = [self.entry(r, self.roofline(r.checkpoint)) for r in records]
        fitting = [e for e in table if e.fits]
        if not fitting:
            _raise_nothing_fits(table, self.budget, self._target_name())
        order = {id(e): i for i, e in enumerate(table)}
        chosen = min(
            fitting, key=lambda e: (e.time_s, e.flops, e.memory_bytes, order[id(e)])
        )
        return self._result(chosen, table, ())

    # --- stage 4: the report -------------------------------------------------

    def _target(self) -> str:
        return self.target or self.hw.kind

    def _target_name(self) -> str:
        for r in self.compiled.values():
            if r.report is not None:
                return r.report.target
        return jax.default_backend() if self.target is None else str(self.target)

    def _result(self, chosen: PlanEntry, table, frontier) -> PlanResult:
        seconds = self.say.elapsed()
        timed = f"; {self._spent()}" if self.timed_s else ""
        self.say(
            f"done: checkpoint={_name(chosen.checkpoint)}, "
            f"{_format_memory(chosen)}, {self.compiles} compiles, "
            f"{seconds:.1f} s{timed}"
        )
        # `fits` against the budget the plan ended with.
        table = [
            e._replace(fits=self._fits(self.compiled[e.checkpoint])) for e in table
        ]
        chosen = chosen._replace(fits=self._fits(self.compiled[chosen.checkpoint]))
        return PlanResult(
            chosen.checkpoint,
            chosen,
            tuple(table),
            self.budget,
            self._target_name(),
            tuple(frontier),
            tuple(self.notes),
            self.compiles,
            seconds,
            self.timed_s,
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


def roofline_seconds(
    fn: Callable[..., Any], *args: Any, target: str | None = None
) -> float:
    """The roofline's estimate of one step of `fn(*args)` on one chip of
    `target`, under the checkpoint that `args`' checkpoint fields hold now:
    the function's FLOPs at the chip's peak, the bytes it moves through
    device memory at its bandwidth, and what it offloads over the host link
    ([`eqx_remat.plan`][]'s cost where it cannot time). A `ranges` mix is its
    parts' estimates, each per layer, weighted by their layers. On the CPU
    the figures are this CPU's, measured once.

    **Raises:** `ValueError` as [`eqx_remat.plan`][] for arguments without a
    `checkpoint` field or a function that differentiates no stack."""
    found = map_checkpoints(args, lambda c: c)[1]
    if not found:
        raise ValueError(
            "roofline_seconds expected arguments containing an eqx.Module with a "
            "`checkpoint` field. Got none."
        )
    if target == jax.default_backend():
        target = None
    with warnings.catch_warnings(), traced_for(target):
        warnings.simplefilter("ignore", ReplicatedArgumentsWarning)
        planner = _Planner(fn, args, 2**62, target, False, _Progress(False), True)
        return planner.roofline(found[0])

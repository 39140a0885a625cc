"""The planner's cost model: how much memory and how long, for any checkpoint or
mix, from what tracing priced (`Prices`) and what compiles and clocks said
(`Evidence`). Pure: no compile, no clock, no cache.

Memory: a uniform option compiled is its compiled memory; another is a base
(learnt from compiled uniform options, interpolated in bytes) plus what each
layer keeps; a mix is `mix_memory` of its two options' bases, corrected by the
compiled mixes. Time: measured where the clock ran the program; else the
roofline (`roofline_time`), scaled by how the clock differs from it (the median
over the timed per-layer options)."""

import dataclasses
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import TypeVar

import numpy as np

from .._inspect._hardware import Hardware
from .._schedules._checkpoint import Checkpoint, Planned
from .._schedules._engine import Schedule
from .._schedules._ranges import ranges
from ._compiled import Compiled
from ._evidence import Evidence
from ._prices import Prices
from ._report import FrontierPoint, PlanEntry
from ._solve import Mix, Option, Predict, Real, linear, roofline_time


T = TypeVar("T")

# How far above the budget the model may put a uniform option that fits when
# compiled, at least: options whose per-layer bytes are equal, or nearly, can
# differ by a few percent once XLA assigns their buffers.
MODEL_ERROR = 0.05
# How far the roofline, scaled to the clock, may be from a program's measured
# time, at least (more where a timed option says so: `CostModel.time_error`):
# programs doing the same work run up to ~8% apart as compiled (issue 50), and
# on transformer-w a floor of 5% left out an option 6% faster than the pick.
TIME_ERROR = 0.10


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Memory and time of checkpoints of one function: `prices` (`None` where
    the function was not priced: then only the roofline of what `evidence`
    priced), `evidence`, and the `hardware` of one chip; `share` is the part
    of the activations one chip holds."""

    prices: Prices | None
    evidence: Evidence
    hardware: Hardware
    share: float = 1.0

    @property
    def per(self) -> int:
        return 1 if self.prices is None else self.prices.per

    def option(self, c: Planned) -> Option | None:
        return None if self.prices is None else self.prices.option(c)

    # --- time --------------------------------------------------------------------

    def scale(self) -> float:
        """Measured over roofline time, the median over the timed per-layer
        options (1 where none was timed): how this device's clock differs
        from the roofline, so that estimates sit beside measurements."""
        ratios = [
            t.seconds / (o.time * self.per)
            for o in (self.prices.options if self.prices else ())
            for t in [self.evidence.timings.get(o.checkpoint)]
            if t is not None and o.time > 0
        ]
        return statistics.median(ratios) if ratios else 1.0

    def estimate(self, flops: Real, moved: Real = 0, host: Real = 0) -> float:
        """The roofline's step time on one chip for the whole function's
        `flops`, bytes `moved` and bytes offloaded to the `host` (all chips
        together), scaled to the clock (`scale`)."""
        s = self.share
        return self.scale() * roofline_time(
            self.hardware, s * flops, s * moved, s * host
        )

    def options(self) -> list[Option]:
        """The per-layer options, each with its time per layer: measured (its
        step time over the depth) where it ran, else the roofline's, scaled.
        One per price: options that keep the same bytes for the same FLOPs
        and roofline time (within 0.1%) are one program to the model, and the
        one that stands for them is the fastest timed, else one compiled,
        else the first."""
        if self.prices is None:
            return []
        scale, ev = self.scale(), self.evidence
        kept: list[Option] = []  # as priced
        out: list[Option] = []
        for p in self.prices.options:
            t = ev.timings.get(p.checkpoint)
            o = p._replace(time=p.time * scale if t is None else t.seconds / self.per)
            i = next((i for i, q in enumerate(kept) if same_price(p, q)), None)
            if i is None:
                kept.append(p)
                out.append(o)
            elif _stands_for(ev, o, out[i]):
                out[i] = o
        return out

    def time_s(self, c: Planned, estimate: float) -> tuple[float, bool]:
        """`(seconds, measured)`: `c`'s measured step time, else `estimate`."""
        t = self.evidence.timings.get(c)
        return (estimate, False) if t is None else (t.seconds, True)

    def time_error(self) -> float:
        """How far the scaled roofline may be from the clock: the most it was
        off for a timed per-layer option, and at least `TIME_ERROR`."""
        scale, prices = self.scale(), self.prices
        return clock_error(
            (t.seconds, scale * o.time * self.per)
            for o in (prices.options if prices else ())
            for t in [self.evidence.timings.get(o.checkpoint)]
            if t is not None
        )

    def priced(self, c: Planned) -> bool:
        """Whether `roofline(c)` can answer (`c` or its parts priced)."""
        if isinstance(c, ranges):
            return all(self.priced(p) for _, p in c.parts)
        return self.option(c) is not None or c in self.evidence.priced

    def roofline(self, c: Planned) -> float:
        """The roofline's step time of `c` on every layer, scaled to the clock:
        a per-layer option's price, else what tracing `c` priced. A `ranges`
        mix is its parts' times per layer, weighted by their layers."""
        if isinstance(c, ranges):
            depth = sum(n for n, _ in c.parts)
            return sum(n * self.roofline(part) for n, part in c.parts) / depth
        o = self.option(c)
        if o is not None:
            return self.scale() * o.time * self.per
        p = self.evidence.priced[c]
        return self.estimate(p.flops, p.moved, p.host)

    def schedule_time(self, c: Planned, flops: int) -> float:
        """A schedule's estimated step time: where its inner policy (or
        `"nothing"`) was timed, that time scaled by the FLOPs (a schedule
        recomputes what its inner policy would, more often); else the
        roofline's."""
        if isinstance(c, Schedule):
            inner = c.policy if c.policy is not None else "nothing"
            t = self.evidence.timings.get(inner)
            record = self.evidence.records.get(inner)
            if t is not None and record is not None and record.flops > 0:
                return t.seconds * flops / record.flops
        return self.roofline(c)

    def needs_price(self, c: Schedule, flops: int) -> bool:
        """Whether `schedule_time(c, flops)` needs `c` priced first."""
        inner = c.policy if c.policy is not None else "nothing"
        timed = inner in self.evidence.timings and inner in self.evidence.records
        return not timed and not self.priced(c)

    # --- memory ------------------------------------------------------------------

    def base(self, o: Option) -> float | None:
        """Memory besides the stack's saved values, learnt from compiled uniform
        options: exact for a compiled one (from XLA's figure, a lower bound,
        for one XLA refused; infinite where it gave none), interpolated in
        bytes between compiled ones otherwise. `None` before any compile."""
        known = []
        for c, record in self.evidence.records.items():
            v = self.option(c)
            if v is None or (record.report is None and c != o.checkpoint):
                continue
            memory = record.memory_bytes
            memory = math.inf if memory is None else memory
            if c == o.checkpoint:
                return memory - self.per * v.bytes
            known.append((v.bytes, memory - self.per * v.bytes))
        return interpolate(known, o.bytes)

    def predict(self, o: Option) -> float | None:
        """Predicted memory of `o` on every layer, or `None` before anything
        was compiled (the base is unknown)."""
        base = self.base(o)
        return None if base is None else max(base + self.per * o.bytes, 0.0)

    def model_error(self) -> float:
        """How far off the model's memory may be: the most it was off for a
        uniform option this call compiled, and at least `MODEL_ERROR`."""
        errors = [
            abs(r.report.total_bytes - p) / r.report.total_bytes
            for c, r in self.evidence.records.items()
            if (p := self.evidence.predicted.get(c)) is not None
            and r.report is not None
            and self.option(c) is not None
        ]
        return max([MODEL_ERROR, *errors])

    def may_fit(
        self, options: Sequence[Option], error: float
    ) -> list[tuple[Option, float]]:
        """The uniform options not compiled yet that may fit, lightest first,
        each with its predicted memory: at most the budget plus a relative
        `error`."""
        near = []
        for o in options:
            predicted = self.predict(o)
            if o.checkpoint in self.evidence.records or predicted is None:
                continue
            if predicted <= self.evidence.budget * (1 + error):
                near.append((o, predicted))
        return sorted(near, key=lambda p: p[1])

    def fewest(self, c: ranges) -> int:
        """After mix `c` compiled over the budget: the most heavy layers worth
        trying next with its two options, stepping by as many layers as the
        compiled excess says."""
        assert self.prices is not None
        (_, light), (n, heavy) = c.parts
        lo, hi = self.prices.option(light), self.prices.option(heavy)
        if lo is None or hi is None:  # not a mix of this function's options
            return 0
        budget = self.evidence.budget
        excess = (self.evidence.records[c].memory_bytes or budget + 1) - budget
        step = max(1, math.ceil(excess / max(hi.bytes - lo.bytes, 1)))
        return max(n - step, 0)

    def floor(self, c: Schedule) -> float:
        """Less memory than schedule `c` can need (0 where unknown): the least
        base memory of a compiled uniform option, the carries `c` stores, and
        the residuals of all but one of the layers it holds at once (the last
        one's may be freed while it is reversed)."""
        assert self.prices is not None
        kept = c.kept(self.per)
        records = self.evidence.records
        bases = [
            b
            for o in self.prices.options
            if o.checkpoint in records and records[o.checkpoint].report is not None
            for b in [self.base(o)]
            if b is not None
        ]
        if kept is None or len(set(self.prices.depths)) > 1 or not bases:
            return 0.0
        carries, layers = kept
        nothing = self.prices.option("nothing")
        inner = self.prices.option(c.policy) or nothing
        assert nothing is not None and inner is not None
        return min(bases) + carries * nothing.bytes + (layers - 1) * inner.bytes

    # --- points ------------------------------------------------------------------

    def entry(self, record: Compiled, estimate: float) -> PlanEntry:
        """The entry of a compiled program, `fits` against the budget now."""
        seconds, measured = self.time_s(record.checkpoint, estimate)
        return PlanEntry(
            record.checkpoint,
            record.memory_bytes,
            record.flops,
            self.evidence.fits(record),
            record.report,
            record.error,
            seconds,
            measured,
        )

    def compiled_point(self, c: Planned, estimate: float) -> FrontierPoint:
        """The point of a compiled `c` (its compiled memory, measured time where
        it ran, else `estimate`)."""
        r = self.evidence.records[c]
        memory = r.memory_bytes or 0
        seconds, measured = self.time_s(c, estimate)
        return FrontierPoint(
            c, memory, memory, r.flops, r.host_bytes, seconds, measured
        )

    def uniform_point(self, o: Option) -> FrontierPoint:
        record = self.evidence.records.get(o.checkpoint)
        compiled = None if record is None else record.report and record.memory_bytes
        seconds, measured = self.time_s(o.checkpoint, o.time * self.per)
        flops = o.total_flops if record is None else record.flops
        return FrontierPoint(
            o.checkpoint,
            int(self.predict(o) or self.per * o.bytes),
            compiled,
            int(flops),
            int(self.per * o.host_bytes),
            seconds,
            measured,
        )

    def mix_point(self, best: Mix) -> FrontierPoint:
        """The point of mix `best`, as predicted (compiled where it was)."""
        assert self.prices is not None
        light, heavy, n = best.light, best.heavy, best.n
        rest = self.per - n
        c = ranges((rest, light.checkpoint), (n, heavy.checkpoint))
        flops = self.prices.flops_none + n * heavy.flops + rest * light.flops
        record = self.evidence.records.get(c)
        estimate = n * heavy.time + rest * light.time
        seconds, measured = self.time_s(c, estimate)
        return FrontierPoint(
            c,
            int(best.predicted),
            None if record is None else record.memory_bytes,
            int(round(flops)),
            int(n * heavy.host_bytes + rest * light.host_bytes),
            seconds,
            measured,
        )

    def compiled_points(self) -> list[FrontierPoint]:
        """Compiled schedules and mixes (the uniform options are priced)."""
        assert self.prices is not None
        opts = {o.checkpoint: o for o in self.options()}
        out = []
        for c, r in self.evidence.records.items():
            if r.report is None or c in opts:
                continue
            if isinstance(c, ranges):
                estimate = sum(n * opts[p].time for n, p in c.parts)
            else:
                estimate = self.schedule_time(c, r.flops)
            predicted = self.evidence.predicted.get(c)
            point = self.compiled_point(c, estimate)
            if predicted is not None:
                point = point._replace(predicted_bytes=int(predicted))
            out.append(point)
        return out


def contenders(m: CostModel) -> list[tuple[Option, float]]:
    """The per-layer options of `m` (one per price, `options`) that can be the
    fastest that fits, lightest first, each with its memory (compiled,
    else predicted): those that fit when compiled or are predicted to
    within `model_error`, and whose time (measured, else estimated) the
    model cannot tell from the fastest of them's: within its error
    (`time_error`) either way."""
    ev, error = m.evidence, m.model_error()
    near = []
    for o in m.options():
        record = ev.records.get(o.checkpoint)
        if record is not None:
            if ev.fits(record):
                near.append((o.time, (o, float(record.memory_bytes or 0))))
            continue
        predicted = m.predict(o)
        if predicted is not None and predicted <= ev.budget * (1 + error):
            near.append((o.time, (o, predicted)))
    return sorted(within_error(near, m.time_error()), key=lambda p: p[1])


def clock_error(pairs: Iterable[tuple[float, float]]) -> float:
    """How far estimates were from the clock: the most `|measured / estimate
    - 1|` over `(measured, estimate)` pairs (estimates of 0 left out), and
    at least `TIME_ERROR`."""
    return max([TIME_ERROR, *(abs(t / e - 1) for t, e in pairs if e > 0)])


def within_error(near: Sequence[tuple[float, T]], error: float) -> list[T]:
    """The items of `(time, item)` pairs whose time a model off by up to
    `error` either way cannot tell from the least: at most `(1 + error) /
    (1 - error)` times it (all of them for an error of 1 or more)."""
    if not near:
        return []
    least = min(t for t, _ in near)
    bar = least * (1 + error) / (1 - error) if error < 1 else math.inf
    return [x for t, x in near if t <= bar]


def mix_predictor(m: CostModel) -> Predict:
    """The memory of a mix as `m` predicts it: the model (`mix_memory`, from
    each option's base), corrected by what compiled mixes (this call's and
    earlier calls' for the same function) taught: where mixes of the same
    two options were compiled, the model's error interpolated over their
    counts (see `_line`); for another pair with the same heavy option, its
    largest error there; for any other pair, the largest excess of any
    compiled mix over the model (none if no mix needed more)."""
    assert m.prices is not None
    by = {o.checkpoint: o for o in m.prices.options}
    bases = {c: m.base(o) or 0.0 for c, o in by.items()}
    model = linear(lambda o: bases[o.checkpoint], m.per)
    errors: dict[tuple, dict[int, float]] = {}  # (light, heavy): {n: error}
    for c, memory in m.evidence.mixes.items():
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
        for c, r in m.evidence.records.items()
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


def same_price(a: Option, b: Option) -> bool:
    """Whether `a` and `b` keep the same bytes for the same FLOPs and time."""
    return (
        (a.bytes, a.host_bytes) == (b.bytes, b.host_bytes)
        and math.isclose(a.total_flops, b.total_flops, rel_tol=1e-3)
        and math.isclose(a.time, b.time, rel_tol=1e-3)
    )


def _stands_for(ev: Evidence, o: Option, twin: Option) -> bool:
    """Whether `o` rather than `twin` (the same price) stands for both: the
    faster timed, else a compiled one."""
    if o.checkpoint in ev.timings:
        return twin.checkpoint not in ev.timings or o.time < twin.time
    return twin.checkpoint not in ev.timings and (
        o.checkpoint in ev.records and twin.checkpoint not in ev.records
    )


def interpolate(known: Sequence[tuple[float, float]], x: float) -> float | None:
    """The value at `x` of the points `known` (`(x, value)` pairs): joined by
    straight lines, held beyond the first and the last; `None` for no point.
    A base memory learnt from compiled programs, by their saved bytes."""
    if not known:
        return None
    known = sorted(known)
    below = [k for k in known if k[0] <= x]
    above = [k for k in known if k[0] >= x]
    if not below or not above:
        return (below or above)[-1 if below else 0][1]
    (b0, m0), (b1, m1) = below[-1], above[0]
    return m0 if b1 == b0 else m0 + (m1 - m0) * (x - b0) / (b1 - b0)


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


def pareto_points(points: Sequence[FrontierPoint]) -> list[FrontierPoint]:
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

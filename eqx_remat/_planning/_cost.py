"""The planner's one cost model (`CostModel`, pure): memory and time of any plan
of `k >= 1` stacks, from `Prices` and `Evidence`. Memory: compiled, else a base
learnt from compiled uniform plans plus what each layer keeps, a mix corrected
by compiled mixes (`mix_predictor`). Time: measured, else each layer's
(measured, else the roofline's scaled to the clock), plus, ahead of time, what
the chips send each other (`sent`). The solver: `best_plan`."""

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from .._inspect._clock import Timing
from .._inspect._compiled import Compiled
from .._inspect._hardware import Hardware, collective_time
from .._inspect._memory import MemoryReport
from .._schedules._checkpoint import Checkpoint, PerStack, Planned
from .._schedules._engine import Schedule
from .._schedules._ranges import ranges
from ._evidence import Evidence
from ._prices import Prices, Stack
from ._report import FrontierPoint, PlanEntry
from ._solve import Option, Predict, best_mix, linear, lower_hull
from ._thresholds import (
    MODEL_ERROR,
    MOST_UNIFORM_PLANS,
    RIVALS,
    SAME_PRICE,
    TIME_ERROR,
)


class Part(NamedTuple):
    """One stack's share of a plan: `n` layers of `heavy`, last, and the rest
    of `light` (`n == 0`: `light` on every layer)."""

    light: Option
    heavy: Option
    n: int


Plan = tuple[Part, ...]
"""A plan: a `Part` per stack, in the order of `Prices.stacks`."""


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Memory and time of plans of one function's stacks (`prices`: `None`
    where not priced), on one chip of `hardware` holding `share` of the
    activations; with `collectives` (ahead of time), an estimate adds what the
    chip sends the others (`sent`)."""

    prices: Prices | None
    evidence: Evidence
    hardware: Hardware
    share: float = 1.0
    collectives: bool = False

    @property
    def stacks(self) -> tuple[Stack, ...]:
        return () if self.prices is None else self.prices.stacks

    def option(self, c: Planned) -> Option | None:
        return None if self.prices is None else self.prices.option(c)

    # --- plans -------------------------------------------------------------------

    def checkpoint(self, plan: Plan) -> Planned:
        """`plan` as `set_checkpoint` takes it (of several stacks, a `PerStack`)."""
        out = {}
        for s, (light, heavy, n) in zip(self.stacks, plan):
            c = light.checkpoint
            if n == s.depth:
                c = heavy.checkpoint
            elif n:
                c = ranges((s.depth - n, light.checkpoint), (n, heavy.checkpoint))
            out[s.path] = c
        return out[self.stacks[0].path] if len(out) == 1 else PerStack(out)

    def plan(self, c: Planned) -> Plan | None:
        """The plan `c` is (`None`: not an option, or a mix of two, per stack)."""
        stacks = self.stacks
        if len(stacks) == 1 and not isinstance(c, PerStack):
            each = {stacks[0].path: c}
        elif isinstance(c, PerStack) and list(c) == [s.path for s in stacks]:
            each = dict(c)
        else:
            return None
        out = []
        for s in stacks:
            k = each[s.path]
            parts = k.parts if isinstance(k, ranges) else ((s.depth, k), (0, k))
            if len(parts) != 2:
                return None
            (m, a), (n, b) = parts
            light, heavy = s.option(a), s.option(b)
            if light is None or heavy is None or m + n != s.depth:
                return None
            out.append(Part(light, heavy, n))
        return tuple(out)

    def uniform_plan(self, c: Planned) -> Plan | None:
        """The plan `c` is where it is one option per stack."""
        plan = self.plan(c)
        return plan if plan is not None and all(p.n == 0 for p in plan) else None

    def at(self, plan: Plan, k: int, o: Option) -> Plan:
        """`plan` with stack `k` on option `o` on every layer."""
        return (*plan[:k], Part(o, o, 0), *plan[k + 1 :])

    def reference(self, k: int, o: Option) -> Plan:
        """Stack `k` on `o`, every other stack on `"nothing"` (as priced)."""
        nothing = [s.option("nothing") or s.options[0] for s in self.stacks]
        return self.at(tuple(Part(o, o, 0) for o in nothing), k, o)

    def saved(self, plan: Plan, field: str = "bytes") -> float | int:
        """The sum of `field` of `plan`'s options over its layers (by default,
        the bytes per chip it keeps beside the base)."""
        return sum(
            ((s.depth - n) * getattr(light, field) + n * getattr(heavy, field))
            for s, (light, heavy, n) in zip(self.stacks, plan)
        )

    def flops(self, plan: Plan) -> float:
        """The whole function's FLOPs under `plan`: each stack's light
        option's, plus what its heavy layers add, plus the base's."""
        assert self.prices is not None
        return self.prices.base.total_flops + sum(
            light.total_flops + n * (heavy.flops - light.flops)
            for light, heavy, n in plan
        )

    def priced(self, plan: Plan, field: str = "time") -> float:
        """`saved(plan, field)` plus the base's, as priced (not scaled)."""
        assert self.prices is not None
        return float(getattr(self.prices.base, field)) + self.saved(plan, field)

    # --- time --------------------------------------------------------------------

    def _timed(self) -> list[tuple[Plan, Timing]]:
        """The uniform plans timed, with their timings."""
        timings = self.evidence.timings.items()
        return [(p, t) for c, t in timings if (p := self.uniform_plan(c)) is not None]

    def scale(self) -> float:
        """The clock over the roofline: the median over the timed uniform plans."""
        ratios = [t.seconds / r for p, t in self._timed() if (r := self.priced(p)) > 0]
        return statistics.median(ratios) if ratios else 1.0

    def layer_time(self, k: int, o: Option, scale: float | None = None) -> float:
        """Option `o`'s time per layer of stack `k`: measured (the others on
        `"nothing"`), else the roofline's, scaled."""
        t = self.evidence.timings.get(self.checkpoint(self.reference(k, o)))
        if t is not None:
            return t.seconds / self.stacks[k].depth
        return o.time * (self.scale() if scale is None else scale)

    def options(self, k: int = 0) -> list[Option]:
        """Stack `k`'s options with their `layer_time`, one per price
        (`same_price`): the fastest timed, else one compiled, else the first."""
        if self.prices is None:
            return []
        scale, ev = self.scale(), self.evidence
        kept: list[Option] = []  # as priced
        out: list[Option] = []
        keys: list[Planned] = []
        for p in self.stacks[k].options:
            o = p._replace(time=self.layer_time(k, p, scale))
            c = self.checkpoint(self.reference(k, p))
            i = next((i for i, q in enumerate(kept) if same_price(p, q)), None)
            if i is None:
                kept.append(p)
                out.append(o)
                keys.append(c)
            elif _stands_for(ev, c, o, keys[i], out[i]):
                out[i], keys[i] = o, c
        return out

    def base_time(self) -> float:
        """The time a plan adds to its layers': minus `k - 1` times every stack
        on `"nothing"` (measured, else the roofline's)."""
        assert self.prices is not None
        k = len(self.stacks) - 1
        if k == 0:
            return 0.0
        nothing = self.reference(
            0, self.stacks[0].option("nothing") or self.stacks[0].options[0]
        )
        t = self.evidence.timings.get(self.checkpoint(nothing))
        return -k * t.seconds if t is not None else self.scale() * self.prices.base.time

    def time(self, plan: Plan) -> tuple[float, bool]:
        """`(seconds, measured)`: measured, else the base plus each layer's."""
        t = self.evidence.timings.get(self.checkpoint(plan))
        if t is not None:
            return t.seconds, True
        scale = self.scale()
        seconds = self.base_time() + self.sent(self.checkpoint(plan))
        for k, (s, (light, heavy, n)) in enumerate(zip(self.stacks, plan)):
            seconds += (s.depth - n) * self.layer_time(k, light, scale)
            seconds += n * self.layer_time(k, heavy, scale)
        return seconds, False

    def time_s(self, c: Planned, estimate: float | None = None) -> tuple[float, bool]:
        """`(seconds, measured)`: measured, else `estimate` (or the roofline)."""
        t = self.evidence.timings.get(c)
        if t is not None:
            return t.seconds, True
        return self.roofline(c) if estimate is None else estimate, False

    def time_error(self) -> float:
        """How far the scaled roofline may be off: the most it was for a timed
        uniform plan, at least `TIME_ERROR`."""
        scale = self.scale()
        estimates = [(t.seconds, scale * self.priced(p)) for p, t in self._timed()]
        return max([TIME_ERROR, *(abs(t / e - 1) for t, e in estimates if e > 0)])

    def can_price(self, c: Planned) -> bool:
        """Whether `roofline(c)` can answer."""
        if self.plan(c) is not None or c in self.evidence.priced:
            return True
        return isinstance(c, ranges) and all(self.can_price(p) for _, p in c.parts)

    def roofline(self, c: Planned) -> float:
        """The roofline's step time of `c`, scaled, and what it `sent`."""
        return self._compute(c) + self.sent(c)

    def _compute(self, c: Planned) -> float:
        """The roofline's time of `c`'s compute, scaled: a plan's from its
        options, else from tracing `c` (a mix: its parts', weighted by their
        layers)."""
        plan = self.plan(c)
        if plan is not None:
            return self.scale() * self.priced(plan)
        if isinstance(c, ranges) and c not in self.evidence.priced:
            depth = sum(n for n, _ in c.parts)
            return sum(n * self._compute(part) for n, part in c.parts) / depth
        price = self.evidence.priced[c]
        return self.scale() * price.seconds(self.hardware, self.share)

    def sent(self, c: Planned, flops: float | int | None = None) -> float:
        """Ahead of time (`collectives`), the seconds one chip takes to send
        what `c`'s collectives send, after its compute (not overlapped: the
        model held against MaxText's runs, `benchmarks/maxtext_mfu.py`):
        compiled, its own; else (refused by XLA too) the compiled uniform
        plans', interpolated in the FLOPs recomputation adds (`flops`: `c`'s,
        where `c` is not a plan), as recomputing a layer gathers its weights
        again. 0 on the clock, on one chip and before a compile."""
        if not self.collectives:
            return 0.0
        reports = {c: r.report for c, r in self.evidence.records.items() if r.report}

        def seconds(r: MemoryReport) -> float:
            sent = r.collective_bytes, r.network_bytes
            return collective_time(self.hardware, *sent) or 0.0

        if c in reports:
            return seconds(reports[c])
        plan = self.plan(c)
        x = flops if plan is None else self.saved(plan, "flops")
        known = [
            (float(self.saved(q, "flops")), seconds(r))
            for k, r in reports.items()
            if (q := self.uniform_plan(k)) is not None
        ]
        return 0.0 if x is None else interpolate(known, float(x)) or 0.0

    def schedule_time(self, c: Planned, flops: int) -> float:
        """A schedule's time: its inner policy's (or `"nothing"`'s) measured
        time scaled by the FLOPs, else the roofline's."""
        if isinstance(c, Schedule):
            inner = c.policy if c.policy is not None else "nothing"
            t = self.evidence.timings.get(inner)
            record = self.evidence.records.get(inner)
            if t is not None and record is not None and record.flops > 0:
                return t.seconds * flops / record.flops
        none = None if self.prices is None else self.prices.option(None)
        added = None if none is None else flops - none.total_flops
        return self._compute(c) + self.sent(c, added)

    def needs_price(self, c: Schedule, flops: int) -> bool:
        """Whether `schedule_time(c, flops)` needs `c` priced first."""
        inner = c.policy if c.policy is not None else "nothing"
        timed = inner in self.evidence.timings and inner in self.evidence.records
        return not timed and not self.can_price(c)

    # --- memory ------------------------------------------------------------------

    def base(self, plan: Plan) -> float | None:
        """Memory besides what uniform `plan` keeps: compiled (refused: XLA's
        figure, or infinite), else interpolated in the bytes kept between
        compiled plans; `None` before any compile."""
        want = self.checkpoint(plan)
        known = []
        for c, record in self.evidence.records.items():
            q = self.uniform_plan(c)
            if q is None or (record.report is None and c != want):
                continue
            memory = record.memory_bytes
            memory = math.inf if memory is None else memory
            if c == want:
                return memory - self.saved(q)
            known.append((self.saved(q), memory - self.saved(q)))
        return interpolate(known, self.saved(plan))

    def predict(self, plan: Plan) -> float | None:
        """`plan`'s predicted memory: the base plus what each layer keeps (a
        mix: `mix_predictor`'s; `None` before any compile)."""
        mixed = [k for k, p in enumerate(plan) if p.n]
        if mixed:
            (k,) = mixed
            light, heavy, n = plan[k]
            return float(mix_predictor(self, k, plan)(light, heavy, np.array(n)))
        base = self.base(plan)
        return None if base is None else max(base + self.saved(plan), 0.0)

    def within(self, predicted: float | None, error: float | None = None) -> bool:
        """Whether memory `predicted` may fit: at most `error` (by default
        `model_error`) over the budget; an unknown one (`None`) may."""
        e = self.model_error() if error is None else error
        return predicted is None or predicted <= self.evidence.budget * (1 + e)

    def model_error(self) -> float:
        """How far the memory may be off: the most it was for a compiled
        uniform plan, at least `MODEL_ERROR`."""
        errors = [
            abs(r.report.total_bytes - p) / r.report.total_bytes
            for c, r in self.evidence.records.items()
            if (p := self.evidence.predicted.get(c)) is not None
            and r.report is not None
            and self.uniform_plan(c) is not None
        ]
        return max([MODEL_ERROR, *errors])


def floor(m: CostModel, c: Schedule) -> float:
    """A bound below schedule `c`'s memory (0: unknown): the least compiled
    base, its carries, and all but one of the layers it holds at once."""
    assert m.prices is not None
    kept = c.kept(m.prices.per)
    records = m.evidence.records
    bases = [
        b
        for o in m.prices.options
        if o.checkpoint in records and records[o.checkpoint].report is not None
        for b in [m.base((Part(o, o, 0),))]
        if b is not None
    ]
    if kept is None or len(set(m.prices.depths)) > 1 or not bases:
        return 0.0
    carries, layers = kept
    nothing = m.prices.option("nothing")
    inner = m.prices.option(c.policy) or nothing
    assert nothing is not None and inner is not None
    return min(bases) + carries * nothing.bytes + (layers - 1) * inner.bytes


def ends(m: CostModel) -> tuple[Plan, Plan]:
    """Every stack on its fastest hull option, and on its lightest."""
    hulls = [lower_hull(m.options(k)) for k in range(len(m.stacks))]
    return (
        tuple(Part(h[-1], h[-1], 0) for h in hulls),
        tuple(Part(h[0], h[0], 0) for h in hulls),
    )


def may_fit(
    m: CostModel, plans: Sequence[Plan], error: float
) -> list[tuple[Plan, float]]:
    """The `plans` not compiled that may fit within `error`, lightest first."""
    near = []
    for plan in plans:
        predicted = m.predict(plan)
        if m.checkpoint(plan) in m.evidence.records or predicted is None:
            continue
        if m.within(predicted, error):
            near.append((plan, predicted))
    return sorted(near, key=lambda p: p[1])


def uniform_plans(m: CostModel) -> list[Plan]:
    """Every plan of one option per stack (over `MOST_UNIFORM_PLANS`: hulls')."""
    kinds = [m.options(k) for k in range(len(m.stacks))]
    if math.prod(map(len, kinds)) > MOST_UNIFORM_PLANS:
        kinds = [lower_hull(o) for o in kinds]
    return [tuple(Part(o, o, 0) for o in x) for x in itertools.product(*kinds)]


def fewest(m: CostModel, c: Planned) -> int:
    """After mix `c` compiled over the budget: the most heavy layers worth
    trying next, less by as many as its excess says."""
    plan = m.plan(c)
    mixed = [p for p in plan or () if p.n]
    if len(mixed) != 1:  # not a mix of this function's options
        return 0
    ((lo, hi, n),) = mixed
    budget = m.evidence.budget
    excess = (m.evidence.records[c].memory_bytes or budget + 1) - budget
    step = max(1, math.ceil(excess / max(hi.bytes - lo.bytes, 1)))
    return max(n - step, 0)


def compiled_point(m: CostModel, c: Planned, estimate: float) -> FrontierPoint:
    """The point of a compiled `c`, its time measured, else `estimate`."""
    r = m.evidence.records[c]
    memory = r.memory_bytes or 0
    seconds, measured = m.time_s(c, estimate)
    return FrontierPoint(c, memory, memory, r.flops, r.host_bytes, seconds, measured)


def point(m: CostModel, plan: Plan, predicted: float | None = None) -> FrontierPoint:
    """The point of `plan`, as predicted, compiled where it was."""
    c = m.checkpoint(plan)
    record = m.evidence.records.get(c)
    compiled = None if record is None else record.report and record.memory_bytes
    predicted = m.predict(plan) if predicted is None else predicted
    flops = m.flops(plan) if record is None else record.flops
    seconds, measured = m.time(plan)
    return FrontierPoint(
        c,
        int(predicted or m.saved(plan)),
        compiled,
        int(round(flops)),
        int(m.priced(plan, "host_bytes")),
        seconds,
        measured,
    )


def points(m: CostModel) -> list[FrontierPoint]:
    """The frontier's candidates: the hull and what compiled (several stacks:
    what compiled)."""
    ev = m.evidence
    if len(m.stacks) > 1:
        plans = [m.plan(c) for c, r in ev.records.items() if r.report]
        return [point(m, p) for p in plans if p is not None]
    opts = {o.checkpoint: o for o in m.options()}
    out = [point(m, (Part(o, o, 0),)) for o in lower_hull(list(opts.values()))]
    for c, r in ev.records.items():
        if r.report is None or c in opts:
            continue
        plan = m.plan(c)
        if plan is not None and plan[0].n:
            estimate = m.time(plan)[0]
        else:
            estimate = m.schedule_time(c, r.flops)
        predicted = ev.predicted.get(c)
        done = compiled_point(m, c, estimate)
        if predicted is not None:
            done = done._replace(predicted_bytes=int(predicted))
        out.append(done)
    return out


def entry(ev: Evidence, record: Compiled, seconds: float, measured: bool) -> PlanEntry:
    """The entry of a compiled program."""
    return PlanEntry(
        record.checkpoint,
        record.memory_bytes,
        record.flops,
        ev.fits(record),
        record.report,
        record.error,
        seconds,
        measured,
    )


def best_plan(
    m: CostModel, limit: Callable[[int, Option, Option], int] | None = None
) -> tuple[Plan, float] | None:
    """The fastest plan predicted to fit and its memory (`None`: none): the
    stacks where the greedy over their hulls leaves them (`descend`), one on
    its best mix (`limit(k, light, heavy)` bounds its heavy layers), or a
    faster uniform plan."""
    budget = m.evidence.budget
    k, fixed = descend(m, budget)
    bound = None if limit is None else (lambda a, b: limit(k, a, b))
    options, depth = m.options(k), m.stacks[k].depth
    mix = best_mix(options, mix_predictor(m, k, fixed), depth, budget, bound)
    best = None
    if mix is not None:
        part = Part(mix.light, mix.heavy, mix.n)
        best = ((*fixed[:k], part, *fixed[k + 1 :]), mix.predicted)
    if len(m.stacks) > 1:
        for plan in uniform_plans(m):
            p = m.predict(plan)
            if p is None or p > budget:
                continue
            if best is None or m.time(plan)[0] < m.time(best[0])[0]:
                best = (plan, p)
    return best


def descend(m: CostModel, budget: float | int) -> tuple[int, Plan]:
    """`(k, plan)`: from every stack's fastest hull option, step down the
    hulls (least time per byte saved first) while over the budget: the stack
    of the last step (to mix) and the plan before it."""
    hulls = [lower_hull(m.options(k)) for k in range(len(m.stacks))]
    at = [len(h) - 1 for h in hulls]

    def plan(at: list[int]) -> Plan:
        return tuple(Part(h[i], h[i], 0) for h, i in zip(hulls, at))

    k = 0
    while len(m.stacks) > 1 and (m.predict(plan(at)) or 0.0) > budget:
        steps = []
        for j, (s, i) in enumerate(zip(m.stacks, at)):
            if i == 0:
                continue
            light, heavy = hulls[j][i - 1], hulls[j][i]
            saved = s.depth * (heavy.bytes - light.bytes)
            slower = s.depth * (light.time - heavy.time)
            steps.append((slower / saved if saved > 0 else math.inf, j))
        if not steps:
            break
        _, k = min(steps)
        before = plan(at)
        at[k] -= 1
        if (m.predict(plan(at)) or 0.0) <= budget:
            return k, before
    return k, plan(at)


def contenders(m: CostModel) -> list[tuple[Option, float]]:
    """One stack's options that may be the fastest that fits, with their
    memory, lightest first: those that fit (or may, by `model_error`) and the
    model cannot tell from the fastest (by `time_error` either way); of those,
    the fastest and its `RIVALS` nearest, as a race runs."""
    ev, error, near = m.evidence, m.model_error(), []
    for o in m.options():
        record = ev.records.get(o.checkpoint)
        if record is not None:
            if ev.fits(record):
                near.append((o.time, (o, float(record.memory_bytes or 0))))
            continue
        predicted = m.predict((Part(o, o, 0),))
        if predicted is not None and m.within(predicted, error):
            near.append((o.time, (o, predicted)))
    # A model off by up to `e` either way cannot tell apart `(1 + e) / (1 - e)`.
    e, least = m.time_error(), min((t for t, _ in near), default=0.0)
    bar = least * (1 + e) / (1 - e) if e < 1 else math.inf
    nearest = sorted(((t, i) for i, (t, _) in enumerate(near) if t <= bar))
    kept = [near[i][1] for _, i in nearest[: 1 + RIVALS]]
    return sorted(kept, key=lambda p: p[1])


def mix_predictor(m: CostModel, k: int = 0, plan: Plan | None = None) -> Predict:
    """The memory of a mix over stack `k` (the others as in `plan`):
    `_linear_at` plus the compiled mixes' error, the pair's over the counts
    (`_line`), else the largest of its heavy option's, else of any mix."""
    s = m.stacks[k]
    if plan is None:
        plan = m.reference(k, s.options[0])
    model = _linear_at(m, plan, k)
    errors: dict[tuple, dict[int, float]] = {}  # (light, heavy): {n: error}
    for c, memory in m.evidence.mixes.items():
        q = m.plan(c)
        if q is None or [j for j, p in enumerate(q) if p.n] != [k]:
            continue
        light, heavy, n = q[k]
        error = memory - float(_linear_at(m, q, k)(light, heavy, np.array(n)))
        errors.setdefault((light.checkpoint, heavy.checkpoint), {})[n] = error
    by_heavy: dict[Checkpoint, float] = {}
    for (_, heavy), at in errors.items():
        by_heavy[heavy] = max(by_heavy.get(heavy, -math.inf), *at.values())
    margin = max([0.0, *by_heavy.values()])
    records = m.evidence.records
    exact = {}
    for o in s.options:
        r = records.get(m.checkpoint(m.at(plan, k, o)))
        if r is not None and r.report is not None:
            exact[o.checkpoint] = r.report.total_bytes

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


def _linear_at(m: CostModel, plan: Plan, k: int) -> Predict:
    """`linear` for a mix over stack `k` of `plan`, the others' bytes added."""
    light, heavy, n = plan[k]
    others = m.saved(plan) - (m.stacks[k].depth - n) * light.bytes - n * heavy.bytes
    bases: dict[Checkpoint, float] = {}

    def base(o: Option) -> float:
        if o.checkpoint not in bases:
            bases[o.checkpoint] = (m.base(m.at(plan, k, o)) or 0.0) + others
        return bases[o.checkpoint]

    return linear(base, m.stacks[k].depth)


def same_price(a: Option, b: Option) -> bool:
    """Whether `a` and `b` keep the same bytes for the same FLOPs and time."""
    return (
        (a.bytes, a.host_bytes) == (b.bytes, b.host_bytes)
        and math.isclose(a.total_flops, b.total_flops, rel_tol=SAME_PRICE)
        and math.isclose(a.time, b.time, rel_tol=SAME_PRICE)
    )


def _stands_for(
    ev: Evidence, c: Planned, o: Option, twin_c: Planned, twin: Option
) -> bool:
    """Whether `o` (`c`) stands for its `twin` of the same price."""
    if c in ev.timings:
        return twin_c not in ev.timings or o.time < twin.time
    return twin_c not in ev.timings and (c in ev.records and twin_c not in ev.records)


def interpolate(known: Sequence[tuple[float, float]], x: float) -> float | None:
    """`known` (`(x, value)` pairs) joined by straight lines and held beyond
    the ends, at `x`; `None` for no point."""
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
    """`at` (count: value) joined by straight lines at the counts `n`, beyond
    them along the least-squares slope (XLA's memory is not monotone in it)."""
    ns = sorted(at)
    values = [at[k] for k in ns]
    out = np.interp(n, ns, values)
    if len(ns) > 1:
        slope = float(np.polyfit(ns, values, 1)[0])
        out = np.where(n < ns[0], values[0] + (n - ns[0]) * slope, out)
        out = np.where(n > ns[-1], values[-1] + (n - ns[-1]) * slope, out)
    return np.asarray(out)

"""Planning several stacks under one budget: each stack its own checkpoint.

Memory and time of a plan are a base plus per-layer terms summed over the
stacks. Each stack's per-layer options are priced with every other stack on
`"nothing"` (by difference from every stack on `"nothing"`, so that the terms
add up exactly under the roofline); the optimum spends the budget where a byte
saved costs least time: from every stack on its fastest option, step the stack
whose next option down its lower hull saves a byte for the least time, until
the plan is predicted to fit (a greedy over the per-stack lower hulls: optimal
for the relaxation, in which at most one stack is mixed). The last step is
rounded to whole layers: that stack runs a `ranges` mix of its two hull
neighbours, as many layers on the lighter one as the budget needs. The base
memory is learnt from compiled plans (the two ends first; on the device at
hand, every stack on `"nothing"` and each stack on each of its options, the
others on `"nothing"`, compiled and timed). The pick is
compiled (a mix that does not fit steps on, at most `MIX_TRIES` times), then
compiled and, on the device at hand, timed beside the per-stack uniform
combinations estimated fastest that are predicted to fit: the fastest that
fits is returned, after a race of those timed within `RULED_OUT` of it. The
batch planner solves each way of running the batch here too (`solve_model`).
Told in the tutorial *Checkpoint your own Equinox model*.
"""

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .._inspect._hardware import Hardware
from .._policies._values import save_names
from .._schedules._checkpoint import Checkpoint, PerStack
from .._schedules._ranges import ranges
from ._bench import Bench, Problem
from ._clock import RULED_OUT
from ._cost import (
    MODEL_ERROR,
    CostModel,
    interpolate,
    pareto_points,
)
from ._evidence import Evidence
from ._loop import (
    MIX_TRIES,
    Compile,
    Solved,
    Time,
    answer,
    close_rivals,
    finish,
    solve,
    spent,
)
from ._report import (
    FrontierPoint,
    PlanEntry,
    raise_nothing_fits,
)
from ._solve import (
    Option,
    lower_hull,
    per_layer_options,
    prefix_options,
    price,
    roofline_time,
)


# How many per-stack uniform combinations, estimated fastest among those that
# may fit, are compiled (and timed) beside the pick.
RIVALS = 4


class StackOptions(NamedTuple):
    """One stack's per-layer options: its path, depth, and each option per
    layer and per chip relative to the stack on `"nothing"` (bytes kept, bytes
    offloaded, FLOPs and roofline time added), and their lower hull."""

    path: str
    depth: int
    options: tuple[Option, ...]
    hull: tuple[Option, ...]


@dataclasses.dataclass(frozen=True)
class StackPrices:
    """What tracing told of a function with several stacks: each stack's
    options, and the function with every stack on `"nothing"`: its roofline
    time (per chip) and FLOPs."""

    stacks: tuple[StackOptions, ...]
    base_time: float
    base_flops: int


def price_stacks(
    fn: Callable[..., Any],
    args: tuple,
    stacks: Sequence[tuple[str, int]],
    hw: Hardware,
    share: float,
    say: Callable[..., None],
) -> StackPrices:
    """Trace `fn` with each stack on each of its options, the others on
    `"nothing"`."""
    depths = frozenset(d for _, d in stacks)
    nothing = {p: "nothing" for p, _ in stacks}

    def traced(c: Any) -> tuple[int, int, int, int, list[str]]:
        return price(fn, args, c, depths)

    d0, h0, f0, m0, _ = traced(PerStack(nothing))
    t0 = roofline_time(hw, share * f0, share * m0, share * h0)
    tags = traced(PerStack({p: None for p in nothing}))[4]
    out = []
    for path, depth in stacks:
        raw: dict[Checkpoint, tuple[int, int, int, int]] = {}
        for c in _options_of(tags, hw.host_bytes_per_s is not None, raw, f0):
            try:
                dev, host, flops, moved, _ = traced(PerStack({**nothing, path: c}))
            except ValueError as e:  # a tag of another stack: not an option here
                if "tags nothing" not in str(e):
                    raise
                continue
            raw[c] = dev - d0, host - h0, flops - f0, moved - m0
        options = tuple(
            Option(
                c,
                share * dev / depth,
                share * host / depth,
                flops / depth,
                (
                    roofline_time(
                        hw,
                        share * (f0 + flops),
                        share * (m0 + moved),
                        share * (h0 + host),
                    )
                    - t0
                )
                / depth,
                f0 + flops,
            )
            for c, (dev, host, flops, moved) in raw.items()
        )
        say(f"priced {len(options)} options of {path} ({depth} layers)", detail=True)
        out.append(StackOptions(path, depth, options, tuple(lower_hull(options))))
    return StackPrices(tuple(out), t0, f0)


def _options_of(tags: list[str], host: bool, raw: dict, f0: int):
    """The per-layer options of one stack, as `per_layer_options` and
    `prefix_options` make them (the prefixes once each tag is priced: `raw`
    fills as the caller prices)."""
    yield from per_layer_options(tags, host)
    singles = [
        (t, raw[save_names(t)][0] - raw["nothing"][0], -raw[save_names(t)][2])
        for t in tags
        if save_names(t) in raw
    ]
    if len(singles) > 1:
        yield from prefix_options(singles, host)


# --- the model --------------------------------------------------------------------


Layers = tuple[Option, Option, int]  # (light, heavy, n): n heavy layers, last


@dataclasses.dataclass(frozen=True)
class StacksModel:
    """Memory and time of a plan of several stacks (pure): a plan gives each
    stack `(light, heavy, n)`."""

    prices: StackPrices
    evidence: Evidence
    hardware: Hardware

    def plan_of(self, layers: Sequence[Layers]) -> PerStack:
        out = {}
        for s, (light, heavy, n) in zip(self.prices.stacks, layers):
            c = light.checkpoint
            if n == s.depth:
                c = heavy.checkpoint
            elif n:
                c = ranges((s.depth - n, light.checkpoint), (n, heavy.checkpoint))
            out[s.path] = c
        return PerStack(out)

    def bytes(self, layers: Sequence[Layers]) -> float:
        return sum(
            (s.depth - n) * light.bytes + n * heavy.bytes
            for s, (light, heavy, n) in zip(self.prices.stacks, layers)
        )

    def roofline(self, layers: Sequence[Layers]) -> float:
        return self.prices.base_time + sum(
            (s.depth - n) * light.time + n * heavy.time
            for s, (light, heavy, n) in zip(self.prices.stacks, layers)
        )

    def known(self) -> dict[PerStack, Sequence[Layers]]:
        """The compiled plans, with their layers."""
        out = {}
        for c in self.evidence.records:
            layers = self.maybe_layers(c)
            if layers is not None:
                out[c] = layers
        return out

    def layers_of(self, c: Any) -> list[Layers]:
        """The layers of plan `c` (a `ValueError` if it is not of these
        stacks' options)."""
        layers = self.maybe_layers(c)
        if layers is None:
            raise ValueError(f"not a plan of these stacks' options: {c}")
        return layers

    def maybe_layers(self, c: Any) -> list[Layers] | None:
        if not isinstance(c, PerStack):
            return None
        out = []
        for s in self.prices.stacks:
            by = {o.checkpoint: o for o in s.options}
            k = c[s.path]
            if isinstance(k, ranges):
                (_, light), (n, heavy) = k.parts
                out.append((by[light], by[heavy], n))
            elif k in by:
                out.append((by[k], by[k], 0))
            else:
                return None
        return out

    def scale(self) -> float:
        """Measured over roofline time, the median over timed plans (1 where
        none was)."""
        ratios = [
            self.evidence.timings[c].seconds / self.roofline(layers)
            for c, layers in self.known().items()
            if c in self.evidence.timings and self.roofline(layers) > 0
        ]
        return statistics.median(ratios) if ratios else 1.0

    def nothing(self) -> PerStack:
        """Every stack on `"nothing"`: what the options are priced against."""
        return PerStack({s.path: "nothing" for s in self.prices.stacks})

    def varied(self, k: int, c: Checkpoint) -> PerStack:
        """Stack `k` on `c`, every other on `"nothing"`."""
        return PerStack({**self.nothing(), self.prices.stacks[k].path: c})

    def options(self, k: int) -> list[Option]:
        """Stack `k`'s options, each with its time per layer: measured where
        it ran (on stack `k`, the others on `"nothing"`, beside every stack on
        `"nothing"`), else the roofline's, scaled to the clock."""
        s, timings = self.prices.stacks[k], self.evidence.timings
        base = timings.get(self.nothing())
        scale = self.scale()
        out = []
        for o in s.options:
            t = timings.get(self.varied(k, o.checkpoint))
            if base is not None and t is not None:
                out.append(o._replace(time=(t.seconds - base.seconds) / s.depth))
            else:
                out.append(o._replace(time=o.time * scale))
        return out

    def hull(self, k: int) -> list[Option]:
        return lower_hull(self.options(k))

    def time(self, layers: Sequence[Layers]) -> tuple[float, bool]:
        """`(seconds, measured)`: the plan's measured time, else the time of
        every stack on `"nothing"` plus each stack's layers' times."""
        c = self.plan_of(layers)
        t = self.evidence.timings.get(c)
        if t is not None:
            return t.seconds, True
        base = self.evidence.timings.get(self.nothing())
        seconds = base.seconds if base else self.prices.base_time * self.scale()
        for k, (s, (light, heavy, n)) in enumerate(zip(self.prices.stacks, layers)):
            by = {o.checkpoint: o.time for o in self.options(k)}
            seconds += (s.depth - n) * by[light.checkpoint] + n * by[heavy.checkpoint]
        return seconds, False

    def base(self, total: float) -> float | None:
        """Memory besides the stacks' saved values at `total` saved bytes:
        learnt from compiled plans (exact at one, interpolated in bytes
        between them, held beyond)."""
        known = [
            (self.bytes(layers), r.memory_bytes - self.bytes(layers))
            for c, layers in self.known().items()
            for r in [self.evidence.records[c]]
            if r.memory_bytes is not None
        ]
        return interpolate(known, total)

    def predict(self, layers: Sequence[Layers]) -> float:
        c = self.plan_of(layers)
        record = self.evidence.records.get(c)
        if record is not None and record.memory_bytes is not None:
            return float(record.memory_bytes)
        total = self.bytes(layers)
        return (self.base(total) or 0.0) + total

    def point(self, layers: Sequence[Layers]) -> FrontierPoint:
        c = self.plan_of(layers)
        record = self.evidence.records.get(c)
        seconds, measured = self.time(layers)
        flops = self.prices.base_flops + sum(
            (s.depth - n) * light.flops + n * heavy.flops
            for s, (light, heavy, n) in zip(self.prices.stacks, layers)
        )
        host = sum(
            (s.depth - n) * light.host_bytes + n * heavy.host_bytes
            for s, (light, heavy, n) in zip(self.prices.stacks, layers)
        )
        return FrontierPoint(
            c,
            int(self.predict(layers)),
            None if record is None else record.memory_bytes,
            int(flops if record is None else record.flops),
            int(host),
            seconds,
            measured,
        )


def greedy(m: StacksModel, budget: float | int) -> list[Layers] | None:
    """The fastest plan predicted to fit: the greedy over the hulls
    (`descend`), or a combination of uniform options per stack where one is
    faster (rounding the greedy's last step to whole layers can cost more than
    another choice of whole options). `None` where nothing is predicted to
    fit."""
    out = descend(m, budget)
    for x in combinations(m):
        if m.predict(x) <= budget and (out is None or m.time(x)[0] < m.time(out)[0]):
            out = x
    return out


def descend(m: StacksModel, budget: float | int) -> list[Layers] | None:
    """Every stack on its fastest hull option, then steps down the hulls by
    the least time per byte saved until the plan is predicted to fit; the
    last step rounded to whole layers of the stack it is on. `None` where
    every stack on its lightest option is predicted over the budget. A mix
    never has one layer of `None` (a range of one layer is not a loop)."""
    hulls = [m.hull(k) for k in range(len(m.prices.stacks))]
    at = [len(h) - 1 for h in hulls]

    def layers(at: list[int]) -> list[Layers]:
        return [(h[i], h[i], 0) for h, i in zip(hulls, at)]

    while m.predict(layers(at)) > budget:
        steps = []
        for k, (s, i) in enumerate(zip(m.prices.stacks, at)):
            if i == 0:
                continue
            light, heavy = hulls[k][i - 1], hulls[k][i]
            saved = s.depth * (heavy.bytes - light.bytes)
            slower = s.depth * (light.time - heavy.time)
            steps.append((slower / saved if saved > 0 else math.inf, k))
        if not steps:
            return None
        _, k = min(steps)
        out = layers(at)
        light, heavy = hulls[k][at[k] - 1], hulls[k][at[k]]
        depth = m.prices.stacks[k].depth
        for n_light in range(1, depth):
            n = depth - n_light  # heavy layers left
            if heavy.checkpoint is None and n == 1:
                continue
            out[k] = (light, heavy, n)
            if m.predict(out) <= budget:
                return out
        at[k] -= 1
    return layers(at)


def combinations(m: StacksModel) -> list[list[Layers]]:
    """Every combination of one uniform option per stack (hull options,
    where the product of all options would be over 4096)."""
    kinds = [s.options for s in m.prices.stacks]
    if math.prod(map(len, kinds)) > 4096:
        kinds = [m.hull(k) for k in range(len(kinds))]
    return [[(o, o, 0) for o in combo] for combo in itertools.product(*kinds)]


# --- the search ---------------------------------------------------------------------


def solve_stacks(
    bench: Bench, problem: Problem, asked: int, stacks: Sequence[tuple[str, int]]
) -> Solved:
    """The plan of several stacks that fits `asked` bytes and runs fastest."""
    prices = bench.cache.get(
        problem.fn,
        problem.k("stack-prices"),
        lambda: price_stacks(
            problem.fn, problem.args, stacks, bench.hardware, problem.share, bench.say
        ),
    )
    bench.say(
        f"{len(stacks)} stacks: "
        + ", ".join(
            f"{s.path} ({s.depth} layers, {len(s.options)} options)"
            for s in prices.stacks
        )
    )
    model = lambda ev: StacksModel(prices, ev, bench.hardware)  # noqa: E731
    ev = bench.start(problem, asked)
    m = model(ev)
    if bench.measure:  # each stack's options run: the clock ranks them
        plans = [m.nothing()] + [
            m.varied(k, o.checkpoint)
            for k, stack in enumerate(prices.stacks)
            for o in stack.options
        ]
        why = "one stack on one option, the others on 'nothing': its time per layer"
    else:  # the two ends, for their base memory
        plans = [
            m.plan_of(
                [(h[-1], h[-1], 0) for h in map(m.hull, range(len(m.prices.stacks)))]
            ),
            m.plan_of(
                [(h[0], h[0], 0) for h in map(m.hull, range(len(m.prices.stacks)))]
            ),
        ]
        why = "an end of the hulls: the base memory"
    for c in dict.fromkeys(plans):
        ev = answer(bench, problem, ev, Compile(c, _predicted(model(ev), c), why))
    ev = answer(bench, problem, ev, Time(tuple(dict.fromkeys(plans))))
    pick = None
    for _ in range(MIX_TRIES):
        pick = greedy(model(ev), ev.budget)
        if pick is None:
            break
        c = model(ev).plan_of(pick)
        if c not in ev.records:
            why = "the plan predicted fastest that fits"
            ev = answer(bench, problem, ev, Compile(c, model(ev).predict(pick), why))
        if ev.fits(ev.records[c]):
            break
        pick = None
    ev, best = _confirm(bench, problem, ev, model, pick)
    m = model(ev)
    if best is None:
        entries = [m_entry(m, c) for c in ev.records]
        raise_nothing_fits(entries, ev.budget, bench.target.label)
    points = [m.point(layers) for layers in m.known().values()]
    entry = m_entry(m, best)
    result = finish(bench, ev, entry, (), pareto_points(points), None, [])
    return Solved(result, ev)


def solve_model(bench: Bench, problem: Problem, asked: int) -> Solved:
    """The checkpoint of `problem` that fits `asked` bytes and runs fastest:
    one per stack where it differentiates several (`solve_stacks`), else
    the one stack's (`solve`)."""
    stacks = bench.stacks(problem)
    if len(stacks) > 1:
        return solve_stacks(bench, problem, asked, stacks)
    return solve(bench, problem, asked)


def _predicted(m: StacksModel, c: PerStack) -> float | None:
    layers = m.maybe_layers(c)
    return None if layers is None or m.base(0.0) is None else m.predict(layers)


def m_entry(m: StacksModel, c: Any) -> PlanEntry:
    """The entry of compiled plan `c`, as every plan's."""
    layers = m.maybe_layers(c)
    estimate = m.time(layers)[0] if layers is not None else 0.0
    return CostModel(None, m.evidence, m.hardware).entry(
        m.evidence.records[c], estimate
    )


def _confirm(
    bench: Bench,
    problem: Problem,
    ev: Evidence,
    model: Callable[[Evidence], StacksModel],
    pick: list[Layers] | None,
) -> tuple[Evidence, Any]:
    """The pick beside the per-stack uniform combinations estimated fastest
    that may fit: compiled, timed where the bench measures, the fastest that
    fits (by the clock, else by estimate) of those and of every other plan
    compiled and timed (`_race`)."""
    m = model(ev)
    limit = ev.budget * (1 + MODEL_ERROR)
    combos = sorted(
        (m.time(x)[0], i, x)
        for i, x in enumerate(combinations(m))
        if m.predict(x) <= limit
    )
    run = [] if pick is None else [m.plan_of(pick)]
    for _, _, x in combos:
        if len(run) >= RIVALS + (pick is not None):
            break
        c = m.plan_of(x)
        if c not in run:
            run.append(c)
    for c in run:
        why = "a per-stack combination estimated among the fastest that may fit"
        ev = answer(bench, problem, ev, Compile(c, _predicted(model(ev), c), why))
    fitting = [c for c in run if ev.fits(ev.records[c])]
    if not fitting:
        return ev, None
    ev = answer(bench, problem, ev, Time(tuple(fitting)))
    m = model(ev)
    # Every plan compiled, timed and fitting competes (on the device at hand,
    # each stack on each option, the others on "nothing"), not only these.
    fitting += [
        c
        for c in m.known()
        if c not in fitting and c in ev.timings and ev.fits(ev.records[c])
    ]
    order = sorted(fitting, key=lambda c: (m.time(m.layers_of(c))[0], fitting.index(c)))
    return _race(bench, problem, ev, order)


def _race(
    bench: Bench, problem: Problem, ev: Evidence, order: list
) -> tuple[Evidence, Any]:
    """The fastest of `order` (fastest first). On the device at hand, the
    first is raced against its `close_rivals`, as many as what is left of
    this call's compile time covers (once per plan cache), and the race
    decides, as for one stack."""
    timed = [c for c in order if c in ev.timings and c in ev.runnable]
    if len(timed) < 2 or timed[0] != order[0]:
        return ev, order[0]
    first = timed[0]
    rivals, n = close_rivals(ev, first, ev.timings[first].seconds, timed)
    if not rivals:
        return ev, first
    run = [first, *rivals[: max(n, 1)]]
    race, seconds = bench.race(problem, run, ev, go=n > 0)
    timings = race.timings
    if timings is None:
        return ev, order[0]
    ev = ev.raced(race, seconds)
    i = min(range(len(run)), key=lambda i: timings[i].seconds)
    bench.say(
        f"raced {len(run)} plans timed within {RULED_OUT:.0%} of the fastest "
        f"in {timings[0].rounds} rounds: the fastest ran "
        f"{timings[i].seconds / timings[0].seconds:.3f}x the first; " + spent(ev)
    )
    return ev, run[i]

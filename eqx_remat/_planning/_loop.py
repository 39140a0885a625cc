"""The planner's one loop, over values, for a function of `k >= 1` stacks (the
algorithm: the tutorial *Fit a model in a budget*). Each stage is a function of
(model, `State`) that returns a request (`Compile`, `Time`, `Trace`, `Race`) or
the next state; `loop` has the bench answer each request and folds the answer
into new evidence (`answer`). Which stages run is chosen once (`solve`):
`measure` (on the device at hand), `choose`, `cheaper`, `schedule_prices`,
`schedules`, `nothing_fits`, `race` (on the device at hand)."""

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

from .._inspect._compiled import Compiled
from .._schedules._checkpoint import Planned, checkpoint_name
from .._util import format_bytes, format_size, format_time
from ._bench import Bench, Problem
from ._cost import (
    CostModel,
    Part,
    best_plan,
    compiled_point,
    contenders,
    ends,
    entry,
    fewest,
    floor,
    may_fit,
    point,
    points,
    uniform_plans,
)
from ._evidence import Evidence, Raced, is_mix
from ._prices import Prices
from ._report import (
    FrontierPoint,
    PlanEntry,
    PlanResult,
    format_memory,
    raise_nothing_fits,
)
from ._solve import lower_hull, pareto
from ._thresholds import MIX_TRIES, MODEL_ERROR, RIVALS, RULED_OUT, UNIFORM_RIVALS


# More requests than this in one stage is a search that does not settle.
_MOST_STEPS = 1000


class Compile(NamedTuple):
    """Compile `checkpoint` (predicted: `predicted` bytes), for the reason `why`."""

    checkpoint: Planned
    predicted: float | int | None = None
    why: str = ""


class Time(NamedTuple):
    """Time those of `checkpoints` that can run here."""

    checkpoints: tuple[Planned, ...]


class Trace(NamedTuple):
    """Price `checkpoint` by tracing (for its roofline)."""

    checkpoint: Planned


class Race(NamedTuple):
    """Race `run` (the pick, then its rivals), where `go` or an earlier call did."""

    run: tuple[Planned, ...]
    go: bool


Request = Compile | Time | Trace | Race


class Swap(NamedTuple):
    """The pick `old` replaced by `new`, `why`: `"compiled"`, or `"race"` with
    `ratio`, `old`'s time over `new`'s."""

    why: str
    old: FrontierPoint
    new: FrontierPoint
    ratio: float = 1.0


class State(NamedTuple):
    """The loop's state: what compiles, clocks and tracing said (`evidence`);
    the `pick` (`None`: not yet, or nothing fits) and its `swaps`; what a stage
    set out to confirm when it started (`todo`)."""

    evidence: Evidence
    pick: FrontierPoint | None = None
    swaps: tuple[Swap, ...] = ()
    todo: tuple = ()


Stage = Callable[[CostModel, State], "Request | State"]


# --- the loop -----------------------------------------------------------------------


def loop(
    bench: Bench,
    problem: Problem,
    model: Callable[[Evidence], CostModel],
    state: State,
    stages: Sequence[Stage],
) -> State:
    """Each of `stages` in turn, its requests answered, until it returns a state."""
    for stage in stages:
        for _ in range(_MOST_STEPS):
            out = stage(model(state.evidence), state)
            if isinstance(out, State):
                state = out
                break
            state = state._replace(evidence=answer(bench, problem, state.evidence, out))
        else:
            raise AssertionError("plan: the search did not settle")
    return state


def answer(bench: Bench, problem: Problem, ev: Evidence, request: Request) -> Evidence:
    """`ev` with the bench's answer to `request` (said)."""
    if isinstance(request, Trace):
        return ev.with_price(
            request.checkpoint, bench.price(problem, request.checkpoint)
        )
    if isinstance(request, Time):
        timed = bench.time(problem, request.checkpoints, ev)
        out = ev.timed(timed.timings, timed.seconds, request.checkpoints)
        least, most, ran_all = timed.rounds
        if most:
            rounds = f"{most}" if least == most else f"{least} to {most}"
            n = len(timed.timings)
            bench.say(
                f"timed {n} program(s): {rounds} interleaved round(s) after a "
                f"warm-up ({most} for {ran_all} not ruled out), "
                f"{timed.seconds:.1f} s; {spent(out)}",
                detail=n < 3,
            )
        return out
    if isinstance(request, Race):
        return _raced(bench, problem, ev, request)
    c, predicted, why = request
    record, fresh_s = bench.compile(problem, c)
    out = ev.compiled(record, fresh_s, predicted, bench.runnable(record))
    what = "does not fit in one chip" if record.report is None else "compiled"
    pred = "" if predicted is None else f" (predicted {format_size(predicted)})"
    took = " (cached)" if fresh_s is None else f" ({fresh_s:.1f} s)"
    bench.say(
        f"{what}: {checkpoint_name(c)}: {format_memory(record)}{pred}, "
        f"{'fits' if out.fits(record) else 'does not fit'}{took}"
        + (f"; why: {why}" if why else ""),
        detail=not why,
    )
    return out


def _raced(bench: Bench, problem: Problem, ev: Evidence, request: Race) -> Evidence:
    """`ev` with the race of `request.run`, on the clock of `run[1]`'s timing."""
    run = request.run
    programs = lambda: [bench.program(problem, ev.records[c]) for c in run]
    pivot = (1, ev.timings[run[1]].seconds)
    timings, took = bench.race(problem, run, programs, ev.left_s, pivot, request.go)
    out = ev.raced(Raced(run, timings), took)
    bench.keep(problem, {c: t for c, t in out.timings.items() if c in run})
    how = "raced the pick"
    if timings is None:
        timings = tuple(ev.timings[c] for c in run)
        how = "no time left to race the pick (the plan's rounds decide)"
    else:
        n = timings[0].rounds
        bench.say(f"raced {len(run)} programs in {n} rounds; {spent(out)}")
    k = min(range(1, len(run)), key=lambda i: timings[i].seconds)
    bench.say(
        f"{how}: {timings[0].seconds / timings[k].seconds:.3f}x the step time of "
        f"{checkpoint_name(run[k])}, the fastest option that fits and is not a mix"
    )
    return out


def spent(ev: Evidence) -> str:
    """How long timing took against the compiles: the bound."""
    over = " (over: the fewest rounds take longer)" if ev.timed_s > ev.compile_s else ""
    return (
        f"timing {ev.timed_s:.1f} s in all, for {ev.compile_s:.1f} s of this call's "
        f"compiles{over}"
    )


# --- solving ------------------------------------------------------------------------


def solve(bench: Bench, problem: Problem, asked: int) -> tuple[PlanResult, Evidence]:
    """The fastest plan of `problem` that fits `asked` bytes, and its evidence."""
    prices = bench.prices(problem)
    model = models(bench, problem, prices)
    m = model(Evidence(asked))
    _say_start(bench, prices)
    references = [
        m.checkpoint(m.reference(k, o))
        for k, s in enumerate(prices.stacks)
        for o in s.options
    ]
    ev = bench.start(problem, asked, list(dict.fromkeys(references)))
    if ev.records:
        bench.say(
            f"{len(ev.records)} option(s) compiled by earlier calls: "
            + ", ".join(map(checkpoint_name, ev.records))
        )
    # Chosen once: on the device at hand every option is compiled and run,
    # the clock ranks them, and the pick races its rivals.
    stages: tuple[Stage, ...] = (choose, cheaper, schedule_prices, schedules)
    stages += (functools.partial(nothing_fits, label=bench.target.label),)
    if bench.measure:
        stages = (measure, *stages, race)
    st = loop(bench, problem, model, State(ev), stages)
    m, pick = model(st.evidence), st.pick
    assert pick is not None
    for k, s in enumerate(prices.stacks):
        of = f" of {s.path}" if len(prices.stacks) > 1 else ""
        hull = ", ".join(
            checkpoint_name(o.checkpoint) for o in lower_hull(m.options(k))
        )
        bench.say(f"lower convex hull{of}: {hull}", detail=True)
    record = st.evidence.records[pick.checkpoint]
    chosen = entry(st.evidence, record, *m.time_s(pick.checkpoint, pick.time_s))
    # By compiled memory (else predicted) and time.
    key = lambda p: (
        p.predicted_bytes if p.compiled_bytes is None else p.compiled_bytes,
        p.time_s,
    )
    frontier = pareto(points(m) + [pick], key)
    result = finish(bench, st.evidence, chosen, (), frontier, prices, st.swaps)
    return result, st.evidence


def _say_start(bench: Bench, prices: Prices) -> None:
    if len(prices.stacks) > 1:
        each = (
            f"{s.path} ({s.depth} layers, {len(s.options)} options)"
            for s in prices.stacks
        )
        bench.say(f"{len(prices.stacks)} stacks: " + ", ".join(each))
    else:
        bench.say(
            f"{len(prices.depths)} stack(s) of {'/'.join(map(str, prices.depths))} "
            f"layers; {len(prices.options)} per-layer options; tags: "
            f"{', '.join(prices.tags) or 'none'}"
        )
    hw, link = bench.hardware, bench.hardware.host_bytes_per_s
    bench.say(
        f"{'timing on' if bench.measure else 'estimating for'} "
        f"{bench.target.name or hw.kind}: {hw.peak_flops / 1e12:.3g} TFLOP/s, "
        f"{hw.memory_bytes_per_s / 1e9:.3g} GB/s"
        + ("" if link is None else f", host link {link / 1e9:g} GB/s")
        + " per chip"
    )


# --- the stages ---------------------------------------------------------------------


def measure(m: CostModel, st: State) -> Request | State:
    """Compiled, then timed: each stack's lightest option and fewest FLOPs; of
    one stack, the `contenders` (and the fewest FLOPs only where a mix may hold
    two layers of it: else it cannot be in the answer); of several, every
    option of every stack."""
    ev, todo = m.evidence, []
    for k, s in enumerate(m.stacks):  # the roofline's order: not moved by the clock
        lightest = min(s.options, key=lambda o: (o.bytes, o.time))
        cheapest = min(s.options, key=lambda o: (o.total_flops, o.bytes))
        todo.append((m.reference(k, lightest), None, _LIGHTEST))
        two = (Part(lightest, cheapest, min(2, s.depth)),)
        if len(m.stacks) > 1 or m.within(m.predict(two)):
            todo.append((m.reference(k, cheapest), None, _CHEAPEST))
    if len(m.stacks) == 1:
        near = contenders(m)
        fastest = min(near, key=lambda p: p[0].time)[0] if near else None
        todo += [((Part(o, o, 0),), p, _close(m, o, fastest)) for o, p in near]
    else:
        why = "one stack on one option, the others on 'nothing': its time per layer"
        todo += [
            (m.reference(k, o), None, why)
            for k, s in enumerate(m.stacks)
            for o in s.options
        ]
    for plan, predicted, why in todo:
        c = m.checkpoint(plan)
        if c not in ev.records:
            return Compile(c, m.predict(plan) if predicted is None else predicted, why)
    run = dict.fromkeys(m.checkpoint(p) for p, _, _ in todo)
    run = [c for c in run if c not in ev.offered]
    return Time(tuple(run)) if run else st


_LIGHTEST = "the lightest option: the base memory of every prediction"
_CHEAPEST = "the fewest FLOPs: how far the roofline is from the clock"


def _close(m: CostModel, o, fastest) -> str:
    """Why contender `o` is compiled: how close it is to the fastest."""
    if o.checkpoint == fastest.checkpoint:
        return "the fastest option predicted to fit"
    return (
        f"may fit, estimated {o.time / fastest.time:.3f}x "
        f"{checkpoint_name(fastest.checkpoint)}, which the model (off by up to "
        f"{m.time_error():.0%} either way) cannot tell apart"
    )


def choose(m: CostModel, st: State) -> Request | State:
    """The pick (`search`), and for `cheaper` the plans of uniform options that
    may fit estimated faster (of several stacks, also the `UNIFORM_RIVALS`
    fastest)."""
    out = search(m)
    if not isinstance(out, FrontierPoint | None):
        return out
    if out is None:
        return st._replace(pick=None)
    pick = _timed(m, out)
    near = may_fit(m, uniform_plans(m), MODEL_ERROR)
    todo = [(p, predicted) for p, predicted in near if m.time(p)[0] < pick.time_s]
    if len(m.stacks) > 1:
        fastest = sorted(near, key=lambda p: m.time(p[0])[0])[:UNIFORM_RIVALS]
        todo += [p for p in fastest if p not in todo]
    todo_cs = tuple((m.checkpoint(p), predicted) for p, predicted in todo)
    return st._replace(pick=pick, todo=todo_cs)


def search(m: CostModel) -> Request | FrontierPoint | None:
    """The next request of the search for the fastest plan predicted to fit,
    or its point (`None`: nothing may fit): the hulls' ends, the best mix's
    ends, the mix; a mix over the budget bounds its pair's heavy layers
    (`fewest`), and after `MIX_TRIES` of them only uniform options are left."""
    ev = m.evidence
    fastest, lightest = ends(m)
    known = [c for c, r in ev.records.items() if r.report and m.uniform_plan(c)]
    for plan, why in ((fastest, "cheapest"), (lightest, "lightest")):
        c = m.checkpoint(plan)
        if c not in ev.records and len(known) < 2:
            why = f"the {why} end of the lower hull: its base memory"
            return Compile(c, m.predict(plan), why)
    failed = ev.failed_mixes()
    limits: dict[tuple, int] = {}
    for c in failed:
        for k, (light, heavy, n) in enumerate(m.plan(c) or ()):
            if n:
                pair = (k, light.checkpoint, heavy.checkpoint)
                limits[pair] = min(limits.get(pair, m.stacks[k].depth), fewest(m, c))
    tries = len(failed) < MIX_TRIES

    def limit(k: int, light, heavy) -> int:
        depth = m.stacks[k].depth
        most = depth if depth > 1 and tries else 0
        return min(limits.get((k, light.checkpoint, heavy.checkpoint), most), most)

    best = best_plan(m, limit)
    if best is None:  # before saying nothing fits: what may, by the model's error
        near = may_fit(m, uniform_plans(m), m.model_error())
        why = "no mix is predicted to fit; this may, by the model's error"
        return Compile(m.checkpoint(near[0][0]), near[0][1], why) if near else None
    plan, predicted = best
    mixed = [k for k, p in enumerate(plan) if p.n]
    sides = [m.at(plan, k, o) for k in mixed for o in plan[k][:2]] or [plan]
    for e in sides:
        if m.checkpoint(e) not in ev.records:
            why = "an end of the best mix: its base" if mixed else "the pick"
            return Compile(m.checkpoint(e), m.predict(e), why)
    # On the device at hand a mix's time is its parts' measured times.
    untimed = tuple(
        c
        for c in dict.fromkeys(m.checkpoint(p) for p in (fastest, lightest, *sides))
        if c not in ev.offered
    )
    if untimed:
        return Time(untimed)
    if not mixed:
        return point(m, plan)
    mix = point(m, plan, predicted)
    if mix.checkpoint not in ev.records:
        why = "the mix predicted to fit, estimated fastest"
        return Compile(mix.checkpoint, predicted, why)
    return mix


def _timed(m: CostModel, pick: FrontierPoint) -> FrontierPoint:
    """`pick` with its compiled FLOPs and measured time."""
    record = m.evidence.records[pick.checkpoint]
    seconds, measured = m.time_s(pick.checkpoint, pick.time_s)
    return pick._replace(flops=record.flops, time_s=seconds, measured=measured)


def cheaper(m: CostModel, st: State) -> Request | State:
    """What `choose` found and the mixes earlier calls raced, compiled (and
    timed): the fastest that fits (`cheapest_compiled`)."""
    if st.pick is None:
        return st
    ev = m.evidence
    for c, predicted in st.todo:
        if c not in ev.records:
            return Compile(c, predicted, "estimated faster than the pick; may fit")
    for c in ev.raced_mixes:
        if c not in ev.records:
            return Compile(c, None, "a mix an earlier call raced")
    run = tuple(
        c
        for c in ev.records
        if (not is_mix(c) or c in ev.raced_mixes) and c not in ev.offered
    )
    if run:
        return Time(run)
    pick = _timed(m, st.pick)
    better = cheapest_compiled(m, pick)
    swaps = st.swaps
    if better.checkpoint != pick.checkpoint:
        swaps = (*swaps, Swap("compiled", pick, better))
    return st._replace(pick=better, swaps=swaps, todo=())


def cheapest_compiled(m: CostModel, pick: FrontierPoint) -> FrontierPoint:
    """`pick`, or a faster compiled plan that fits and is not a mix (unless raced)."""
    ev = m.evidence
    fitting = []
    for i, (c, r) in enumerate(ev.records.items()):
        if not ev.fits(r) or (is_mix(c) and c not in ev.timings):
            continue
        if c == pick.checkpoint:
            continue
        plan = m.plan(c)
        estimate = m.schedule_time(c, r.flops) if plan is None else m.time(plan)[0]
        seconds, _ = m.time_s(c, estimate)
        fitting.append((seconds, i, c, estimate))
    if not fitting or min(fitting)[0] >= pick.time_s:
        return pick
    _, _, c, estimate = min(fitting)
    return compiled_point(m, c, estimate)


def schedule_prices(m: CostModel, st: State) -> Request | State:
    """The schedules priced, then for `schedules` those estimated faster than
    the pick, fastest first."""
    assert m.prices is not None
    for c, flops in m.prices.schedules:
        if m.needs_price(c, flops):
            return Trace(c)
    reports = [r.report for r in m.evidence.records.values() if r.report is not None]
    if reports and m.evidence.budget < (
        reports[0].argument_bytes + reports[0].output_bytes
    ):
        return st._replace(todo=())  # every checkpoint needs them
    estimates = sorted(
        (m.schedule_time(c, flops), i, c)
        for i, (c, flops) in enumerate(m.prices.schedules)
    )
    pick = st.pick
    return st._replace(
        todo=tuple(e for e in estimates if pick is None or e[0] < pick.time_s)
    )


def schedules(m: CostModel, st: State) -> Request | State:
    """The first schedule found that fits and beats the pick; where nothing
    fits, for `nothing_fits`, those whose floor is below the least memory."""
    ev, pick = m.evidence, st.pick
    for estimate, _, c in st.todo:
        if floor(m, c) > ev.budget:
            continue
        if c not in ev.records:
            return Compile(c, None, "a schedule estimated faster than the pick")
        if not ev.fits(ev.records[c]):
            continue
        if c not in ev.offered:
            return Time((c,))
        done = compiled_point(m, c, estimate)
        if pick is None or done.time_s < pick.time_s:
            pick = done
            break
    if pick is not None:
        return st._replace(pick=pick, todo=())
    assert m.prices is not None
    least = min(
        (r.report.total_bytes for r in ev.records.values() if r.report), default=None
    )
    todo = [c for c, _ in m.prices.schedules if least is None or floor(m, c) < least]
    return st._replace(pick=None, todo=tuple(todo))


def nothing_fits(m: CostModel, st: State, *, label: str) -> Request | State:
    """Where nothing fits: the schedules left compiled, then `NothingFits`."""
    if st.pick is not None:
        return st
    ev = m.evidence
    for c in st.todo:
        if c not in ev.records:
            return Compile(c, None, "nothing fits: a schedule that may need less")
    out = traced(list(ev.records))(m, st)
    if out is not st:
        return out
    entries = [entry(ev, r, *m.time_s(c)) for c, r in ev.records.items()]
    raise_nothing_fits(entries, ev.budget, target_name(label, ev))


def race(m: CostModel, st: State) -> Request | State:
    """The pick raced against its rivals: the plans that fit, are not a mix and
    were timed within `RULED_OUT` of the fastest (at most `RIVALS`, as many as
    the time left covers a warm-up and two rounds of; a mix not timed races
    one at least)."""
    ev, pick = m.evidence, st.pick
    assert pick is not None
    c0 = pick.checkpoint
    if c0 not in ev.runnable:
        return st
    done = next((r for r in ev.races if r.run[0] == c0), None)
    if done is None:
        measured = c0 in ev.timings
        fitting = sorted(
            (
                c
                for c, r in ev.records.items()
                if ev.fits(r) and not is_mix(c) and c in ev.timings and c in ev.runnable
            ),
            key=lambda c: ev.timings[c].seconds,
        )
        bar = (1 + RULED_OUT) * min((ev.timings[c].seconds for c in fitting), default=0)
        rivals = [c for c in fitting if ev.timings[c].seconds <= bar and c != c0]
        rivals, n = rivals[:RIVALS], 0
        step = ev.timings[c0].seconds if measured else pick.time_s
        for c in rivals:  # a warm-up and two rounds of each program raced
            step += ev.timings[c].seconds
            if 3 * step > ev.left_s:
                break
            n += 1
        if rivals:
            return Race((c0, *rivals[: max(n, 1)]), go=n > 0 or not measured)
        if not measured and c0 not in ev.offered:  # timed beside the plan's clock
            return Time((c0,))
        seconds, measured = m.time_s(c0, pick.time_s)
        return st._replace(pick=pick._replace(time_s=seconds, measured=measured))
    run = done.run
    timings = done.timings or tuple(ev.timings[c] for c in run)
    k = min(range(1, len(run)), key=lambda i: timings[i].seconds)
    ratio = timings[0].seconds / timings[k].seconds
    if ratio < 1.0:
        return st._replace(pick=pick._replace(time_s=timings[0].seconds, measured=True))
    best = compiled_point(m, run[k], timings[k].seconds)
    best = best._replace(time_s=timings[k].seconds, measured=True)
    return st._replace(pick=best, swaps=(*st.swaps, Swap("race", pick, best, ratio)))


def traced(cs: Sequence[Planned]) -> Stage:
    """A stage: each of `cs` not timed priced by tracing (its roofline)."""

    def stage(m: CostModel, st: State) -> Request | State:
        need = [c for c in cs if c not in m.evidence.timings and not m.can_price(c)]
        return Trace(need[0]) if need else st

    return stage


def compiled(
    todo: Sequence[tuple[Planned, float | int | None]],
    why: str = "",
    *,
    until_fits: bool = False,
) -> Stage:
    """A stage: each `(checkpoint, predicted)` of `todo` compiled in turn, for
    the reason `why`; with `until_fits`, until one fits."""

    def stage(m: CostModel, st: State) -> Request | State:
        ev = m.evidence
        for c, predicted in todo:
            if c not in ev.records:
                return Compile(c, predicted, why)
            if until_fits and ev.fits(ev.records[c]):
                break
        return st

    return stage


def timing(cs: Callable[[Evidence], Sequence[Planned]]) -> Stage:
    """A stage: the checkpoints `cs(evidence)` names timed where they run."""

    def stage(m: CostModel, st: State) -> Request | State:
        run = tuple(c for c in cs(m.evidence) if c not in m.evidence.offered)
        return Time(run) if run else st

    return stage


def models(
    bench: Bench, problem: Problem, prices: Prices | None
) -> Callable[[Evidence], CostModel]:
    """`problem`'s cost model on `bench`'s hardware, for any evidence; ahead of
    time, with the collectives (on the clock, they are in what it measures)."""
    return functools.partial(
        CostModel,
        prices,
        hardware=bench.hardware,
        share=problem.share,
        collectives=not bench.measure,
    )


def target_name(label: str, ev: Evidence) -> str:
    for r in ev.records.values():
        if r.report is not None:
            return r.report.target
    return label


# --- candidates ---------------------------------------------------------------------


def compare(
    bench: Bench, problem: Problem, asked: int, candidates: Sequence[Planned]
) -> PlanResult:
    """The fastest of `candidates` that fits, each compiled (and timed)."""
    bench.say(
        f"compiling {len(candidates)} candidates for "
        f"{bench.target.name or bench.hardware.kind}"
    )
    model = models(bench, problem, None)
    stages = [compiled([(c, None) for c in candidates]), timing(lambda _: candidates)]
    st = State(bench.start(problem, asked))
    ev = loop(bench, problem, model, st, [*stages, traced(candidates)]).evidence
    m = model(ev)
    table = [entry(ev, ev.records[c], *m.time_s(c)) for c in candidates]
    fitting = [e for e in table if e.fits]
    if not fitting:
        raise_nothing_fits(table, ev.budget, target_name(bench.target.label, ev))
    # Of equals, the first given (`min` keeps the first).
    chosen = min(fitting, key=lambda e: (e.time_s, e.flops, e.memory_bytes))
    return finish(bench, ev, chosen, table, (), None, [])


# --- the report -----------------------------------------------------------------------


def finish(
    bench: Bench,
    ev: Evidence,
    chosen: PlanEntry,
    table: Sequence[PlanEntry],
    frontier: Sequence[FrontierPoint],
    prices: Prices | None,
    swaps: Sequence[Swap],
) -> PlanResult:
    """The result, the notes and the closing progress line said."""
    said = notes(bench, ev, prices, swaps)
    for n in said:
        bench.say(f"note: {n}")
    seconds = bench.say.elapsed()
    timed = f"; {spent(ev)}" if ev.timed_s else ""
    bench.say(
        f"done: checkpoint={checkpoint_name(chosen.checkpoint)}, "
        f"{format_memory(chosen)}, {ev.compiles} compiles, {seconds:.1f} s{timed}"
    )
    table = [e._replace(fits=ev.fits(ev.records[e.checkpoint])) for e in table]
    chosen = chosen._replace(fits=ev.fits(ev.records[chosen.checkpoint]))
    return PlanResult(
        chosen.checkpoint,
        chosen,
        tuple(table),
        ev.budget,
        target_name(bench.target.label, ev),
        tuple(frontier),
        tuple(said),
        ev.compiles,
        seconds,
        ev.timed_s,
        estimate=bench.hardware.estimate_note(
            not bench.measure and any(map(_sends, ev.records.values()))
        ),
    )


def _sends(record: Compiled) -> bool:
    """Whether `record`'s chips send each other anything."""
    r = record.report
    return r is not None and r.collective_bytes + r.network_bytes > 0


def notes(
    bench: Bench, ev: Evidence, prices: Prices | None, swaps: Sequence[Swap] = ()
) -> list[str]:
    """What the user should know: the budget cut to the device, its figures
    unknown, stacks not mixed, mixes that did not fit, picks replaced."""
    out = []
    if ev.capacity is not None and ev.asked > ev.capacity:
        out.append(
            f"the budget, {format_bytes(ev.asked)}, is more than one device "
            f"holds ({format_bytes(ev.capacity)}): planning for that"
        )
    xla, before = ev.xla_capacity, min(ev.asked, ev.capacity or ev.asked)
    if xla is not None and xla < before:
        out.append(
            f"the budget, {format_bytes(before)}, is more than one device holds: "
            f"XLA says {format_bytes(xla)}; planning for that"
        )
    if not bench.known:
        hw = bench.hardware
        out.append(
            f"this device's figures are unknown; priced as {hw.kind} ({hw.source})"
        )
    if prices is not None:
        if len(prices.stacks) == 1 and len(set(prices.depths)) > 1:
            out.append(
                f"stacks of different depths ({', '.join(map(str, prices.depths))}) "
                "cannot share layer ranges: comparing uniform options only"
            )
        out += [*prices.notes, *_mix_notes(CostModel(prices, ev, bench.hardware))]
    for s in swaps:
        old, new = checkpoint_name(s.old.checkpoint), checkpoint_name(s.new.checkpoint)
        if s.why == "compiled":
            out.append(
                f"{old} takes {format_time(s.old.time_s)} a step: {new}, compiled "
                f"and fitting, is faster ({format_time(s.new.time_s)}); choosing it"
            )
        else:
            out.append(
                f"{old} ran {s.ratio:.3f}x the step time of {new}, which fits: "
                f"choosing {new}"
            )
    return out


def _mix_notes(m: CostModel) -> list[str]:
    """The mixes that did not fit, each with what it compiled to."""
    ev, out = m.evidence, []
    failed = ev.failed_mixes()
    for c in failed:
        mixed = [p for p in m.plan(c) or () if p.n]
        if not mixed:
            continue
        ((light, heavy, _),) = mixed
        predicted = ev.predicted.get(c)
        out.append(
            f"{checkpoint_name(c)} was predicted to fit "
            f"({format_size(predicted or 0)}) but compiled to "
            f"{format_memory(ev.records[c])}: at most {fewest(m, c)} layers of "
            f"{checkpoint_name(heavy.checkpoint)} with "
            f"{checkpoint_name(light.checkpoint)}"
        )
    if len(failed) >= MIX_TRIES:
        out.append(
            f"{len(failed)} mixes did not fit when compiled: XLA's memory is not "
            "the model's here; choosing among uniform options"
        )
    return out

"""The planner's search: a short loop over values (the algorithm is told once, in
the tutorial *Fit a model in a budget*).

Each stage asks the cost model (`CostModel`, pure) what to confirm next: a
`Compile`, a `Time` or a `Trace` request, or nothing. `settle` hands each
request to the bench (`Bench`, the only part with effects) and folds its
answer into new `Evidence`, until the stage asks for nothing; the stage's
answer is then read off the model. The stages, in order:

1. measure (on the device at hand): the lightest option and the one with
   the fewest FLOPs compiled, then the options that may fit and that the
   model cannot rank apart within its error (`contenders`), and all of them
   run;
2. choose: the cheapest mix predicted to fit (`best_mix`), its options and
   then the mix compiled, until what is compiled fits;
3. the cheapest compiled: options estimated faster and that may fit, compiled
   and timed, beside mixes earlier calls raced;
4. schedules: whole-stack schedules estimated faster than the pick;
5. race (on the device at hand): the pick run beside the options timed within
   the noise of it.

Notes and progress lines are produced from the evidence and the stages'
answers (`Swap`s), not threaded through the search.
"""

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .._inspect._memory import ReplicatedArgumentsWarning
from .._inspect._targets import Target
from .._schedules._checkpoint import (
    Checkpoint,
    Planned,
    checkpoint_name,
    map_checkpoints,
)
from .._schedules._ranges import ranges
from .._util import format_bytes
from ._bench import Bench, Problem
from ._clock import RULED_OUT
from ._cost import MODEL_ERROR, CostModel, contenders, mix_predictor, pareto_points
from ._evidence import Evidence
from ._prices import Prices
from ._report import (
    FrontierPoint,
    PlanEntry,
    PlanResult,
    format_memory,
    format_size,
    format_time,
    raise_nothing_fits,
)
from ._solve import best_mix, lower_hull


# A call compiles at most this many mixes that do not fit, then chooses among
# uniform options (each compile of a large model on TPU v5e takes minutes).
MIX_TRIES = 6
# More requests than this in one stage is a search that does not settle.
_MOST_STEPS = 1000


class Compile(NamedTuple):
    """Compile `checkpoint` (the model predicted `predicted` bytes for it),
    for the reason `why` (said in the progress line)."""

    checkpoint: Planned
    predicted: float | int | None = None
    why: str = ""


class Time(NamedTuple):
    """Run `checkpoints` (those that can run here) to time them."""

    checkpoints: tuple[Planned, ...]


class Trace(NamedTuple):
    """Price `checkpoint` by tracing (for its roofline)."""

    checkpoint: Planned


Request = Compile | Time | Trace


class Swap(NamedTuple):
    """A stage's answer that replaced the pick: `old` by `new`, `why` (the
    stage: `"compiled"`, or `"race"` with `ratio`, `old`'s time over `new`'s)."""

    why: str
    old: FrontierPoint
    new: FrontierPoint
    ratio: float = 1.0


# --- the loop ---------------------------------------------------------------------


def settle(
    bench: Bench,
    problem: Problem,
    ev: Evidence,
    ask: Callable[[Evidence], Request | None],
) -> Evidence:
    """Ask, confirm on the bench, fold, until `ask` asks for nothing."""
    for _ in range(_MOST_STEPS):
        request = ask(ev)
        if request is None:
            return ev
        ev = answer(bench, problem, ev, request)
    raise AssertionError("plan: the search did not settle")


def answer(bench: Bench, problem: Problem, ev: Evidence, request: Request) -> Evidence:
    """`ev` with the bench's answer to `request` folded in."""
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
    c = request.checkpoint
    record, fresh_s = bench.compile(problem, c)
    out = ev.compiled(record, fresh_s, request.predicted, bench.runnable(record))
    what = "does not fit in one chip" if record.report is None else "compiled"
    pred = (
        ""
        if request.predicted is None
        else f" (predicted {format_size(request.predicted)})"
    )
    bench.say(
        f"{what}: {checkpoint_name(c)}: {format_memory(record)}{pred}, "
        f"{'fits' if out.fits(record) else 'does not fit'}"
        + (f" ({fresh_s:.1f} s)" if fresh_s is not None else " (cached)")
        + (f"; why: {request.why}" if request.why else ""),
        detail=not request.why,
    )
    return out


def spent(ev: Evidence | Sequence[Evidence]) -> str:
    """How long timing took against the compiles: the bound."""
    evs = [ev] if isinstance(ev, Evidence) else list(ev)
    timed, fresh = sum(e.timed_s for e in evs), sum(e.compile_s for e in evs)
    over = " (over: the fewest rounds take longer)" if timed > fresh else ""
    return (
        f"timing {timed:.1f} s in all, for {fresh:.1f} s of this call's compiles{over}"
    )


def _model(bench: Bench, problem: Problem, prices: Prices | None):
    return lambda ev: CostModel(prices, ev, bench.hardware, problem.share)


# --- solving ------------------------------------------------------------------------


class Solved(NamedTuple):
    """A solved plan: the result, and the evidence it stands on."""

    result: PlanResult
    evidence: Evidence


def solve(bench: Bench, problem: Problem, asked: int) -> Solved:
    """The checkpoint of `problem` that fits `asked` bytes and runs fastest."""
    prices = bench.prices(problem)
    model = _model(bench, problem, prices)
    _say_start(bench, prices)
    ev = bench.start(problem, asked, [o.checkpoint for o in prices.options])
    if ev.records:
        bench.say(
            f"{len(ev.records)} option(s) compiled by earlier calls: "
            + ", ".join(map(checkpoint_name, ev.records))
        )
    if bench.measure:  # every option is compiled and run: the clock ranks them
        ev = settle(bench, problem, ev, lambda ev: _ask_options(model(ev)))
    ev = settle(bench, problem, ev, lambda ev: _request(search(model(ev))))
    pick = _point(search(model(ev)))
    swaps: list[Swap] = []
    if pick is not None:
        pick = _timed(model(ev), pick)
        todo = [
            (o.checkpoint, p)
            for o, p in model(ev).may_fit(model(ev).options(), MODEL_ERROR)
            if o.time * prices.per < pick.time_s
        ]
        ev = settle(bench, problem, ev, lambda ev: _ask_cheaper(model(ev), todo))
        pick = _timed(model(ev), pick)
        better = cheapest_compiled(model(ev), pick)
        if better.checkpoint != pick.checkpoint:
            swaps.append(Swap("compiled", pick, better))
        pick = better
    ev = settle(bench, problem, ev, lambda ev: _ask_schedule_prices(model(ev)))
    cheaper = _cheaper_schedules(model(ev), pick)
    ev = settle(
        bench, problem, ev, lambda ev: _request(_schedule(model(ev), cheaper, pick))
    )
    pick = _point(_schedule(model(ev), cheaper, pick))
    if pick is None:
        _nothing_fits(bench, problem, ev, model)
    assert pick is not None
    if bench.measure:
        pick, swaps, ev = _race(bench, problem, model, ev, pick, swaps)
    m = model(ev)
    hull = lower_hull(m.options())
    bench.say(
        "lower convex hull: " + ", ".join(checkpoint_name(o.checkpoint) for o in hull),
        detail=True,
    )
    points = [m.uniform_point(o) for o in hull] + m.compiled_points()
    entry = m.entry(ev.records[pick.checkpoint], pick.time_s)
    frontier = pareto_points(points + [pick])
    return Solved(finish(bench, ev, entry, (), frontier, prices, swaps), ev)


def _say_start(bench: Bench, prices: Prices) -> None:
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


def _request(step: Any) -> Request | None:
    return step if isinstance(step, Compile | Time | Trace) else None


def _point(step: Any) -> FrontierPoint | None:
    return step if isinstance(step, FrontierPoint) else None


def _timed(m: CostModel, pick: FrontierPoint) -> FrontierPoint:
    """`pick` with its compiled FLOPs and its measured time where it ran."""
    record = m.evidence.records[pick.checkpoint]
    seconds, measured = m.time_s(pick.checkpoint, pick.time_s)
    return pick._replace(flops=record.flops, time_s=seconds, measured=measured)


def _ask_options(m: CostModel) -> Request | None:
    """On the device at hand, before the search: the two ends of the roofline
    compiled, the lightest option (the base memory every prediction starts
    from) and the one with the fewest FLOPs (its time says how far the
    roofline's traffic is from the clock), then each of the `contenders`
    (the options that may fit and that the model cannot rank apart),
    lightest first; then all of them timed, again while timing moves the
    bar (the scale, and the model's error, are the clock's)."""
    ev = m.evidence
    assert m.prices is not None  # the roofline's order: not moved by the clock
    lightest = min(m.prices.options, key=lambda o: (o.bytes, o.time))
    cheapest = min(m.prices.options, key=lambda o: (o.total_flops, o.bytes))
    for o, why in (
        (lightest, "the lightest option: the base memory of every prediction"),
        (cheapest, "the fewest FLOPs: how far the roofline is from the clock"),
    ):
        if o.checkpoint not in ev.records:
            return Compile(o.checkpoint, m.predict(o), why)
    near = contenders(m)
    fastest = min(near, key=lambda p: p[0].time)[0] if near else None
    for o, predicted in near:
        if o.checkpoint not in ev.records:
            assert fastest is not None
            return Compile(o.checkpoint, predicted, _close(m, o, fastest))
    run = tuple(
        c
        for c in (
            lightest.checkpoint,
            cheapest.checkpoint,
            *(o[0].checkpoint for o in near),
        )
        if c not in ev.offered
    )
    return Time(tuple(dict.fromkeys(run))) if run else None


def _close(m: CostModel, o, fastest) -> str:
    """Why contender `o` is compiled: how close the model puts it to the
    fastest contender."""
    if o.checkpoint == fastest.checkpoint:
        return "the fastest option predicted to fit"
    return (
        f"may fit, estimated {o.time / fastest.time:.3f}x "
        f"{checkpoint_name(fastest.checkpoint)}, which the model (off by up to "
        f"{m.time_error():.0%} either way) cannot tell apart"
    )


def search(m: CostModel) -> Request | FrontierPoint | None:
    """What to compile next in the search for the cheapest mix predicted to fit,
    or the answer: its point (compiled, and fitting), or `None` where nothing
    may fit. The hull's two ends are compiled first (the cheapest and the
    lightest: their base memory), unless two options are compiled already
    (the bases between them are interpolated), then the ends of the best mix (on the
    device at hand, all of them timed: a mix's time is predicted from its
    parts'), then the mix; a mix over the budget bounds the heavy layers of
    its pair (`fewest`), and after `MIX_TRIES` of them only uniform options
    are chosen among."""
    ev = m.evidence
    options = m.options()
    hull = lower_hull(options)
    known = [c for c, r in ev.records.items() if r.report and m.option(c)]
    for o, why in ((hull[-1], "cheapest"), (hull[0], "lightest")):
        if o.checkpoint not in ev.records and len(known) < 2:
            why = f"the {why} end of the lower hull: its base memory"
            return Compile(o.checkpoint, m.predict(o), why)
    failed = ev.failed_mixes()
    most = m.per if m.per > 1 and len(failed) < MIX_TRIES else 0
    limits: dict[tuple, int] = {}
    for c in failed:
        pair = (c.parts[0][1], c.parts[1][1])
        limits[pair] = min(limits.get(pair, m.per), m.fewest(c))
    best = best_mix(
        options,
        mix_predictor(m),
        m.per,
        ev.budget,
        lambda light, heavy: min(
            limits.get((light.checkpoint, heavy.checkpoint), most), most
        ),
    )
    if best is None:  # before saying nothing fits: what may, by the model's error
        near = m.may_fit(options, m.model_error())
        why = "no mix is predicted to fit; this may, by the model's error"
        return Compile(near[0][0].checkpoint, near[0][1], why) if near else None
    ends = (best.light,) if best.n == 0 else (best.light, best.heavy)
    for o in ends:
        if o.checkpoint not in ev.records:
            why = "the pick" if best.n == 0 else "an end of the best mix: its base"
            return Compile(o.checkpoint, m.predict(o), why)
    # On the device at hand a mix's time is its parts' measured times.
    untimed = tuple(
        o.checkpoint
        for o in (hull[-1], hull[0], *ends)
        if o.checkpoint not in ev.offered
    )
    if untimed:
        return Time(tuple(dict.fromkeys(untimed)))
    if best.n == 0:
        return m.uniform_point(best.light)
    point = m.mix_point(best)
    if point.checkpoint not in ev.records:
        why = "the mix predicted to fit, estimated fastest"
        return Compile(point.checkpoint, best.predicted, why)
    return point


def _ask_cheaper(
    m: CostModel, todo: Sequence[tuple[Checkpoint, float]]
) -> Request | None:
    """The options estimated faster than the pick that may fit (`todo`), the
    mixes earlier calls raced, then every compiled option timed."""
    ev = m.evidence
    for c, predicted in todo:
        if c not in ev.records:
            return Compile(c, predicted, "estimated faster than the pick; may fit")
    for c in ev.raced_mixes:
        if c not in ev.records:
            return Compile(c, None, "a mix an earlier call raced")
    run = tuple(
        c
        for c in ev.records
        if (not isinstance(c, ranges) or c in ev.raced_mixes) and c not in ev.offered
    )
    return Time(run) if run else None


def cheapest_compiled(m: CostModel, pick: FrontierPoint) -> FrontierPoint:
    """`pick`, or, if a compiled uniform option or schedule that fits is faster,
    or a mix that fits and was timed (by an earlier call's race), that one."""
    ev = m.evidence
    fitting = []
    for i, (c, r) in enumerate(ev.records.items()):
        if not ev.fits(r) or (isinstance(c, ranges) and c not in ev.timings):
            continue
        if c == pick.checkpoint:
            continue
        o = m.option(c)
        estimate = o.time * m.per if o is not None else m.schedule_time(c, r.flops)
        seconds, _ = m.time_s(c, estimate)
        fitting.append((seconds, i, c, estimate))
    if not fitting or min(fitting)[0] >= pick.time_s:
        return pick
    _, _, c, estimate = min(fitting)
    return m.compiled_point(c, estimate)


def _ask_schedule_prices(m: CostModel) -> Request | None:
    assert m.prices is not None
    for c, flops in m.prices.schedules:
        if m.needs_price(c, flops):
            return Trace(c)
    return None


def _cheaper_schedules(m: CostModel, pick: FrontierPoint | None) -> list[tuple]:
    """The schedules estimated faster than `pick`, fastest first."""
    assert m.prices is not None
    reports = [r.report for r in m.evidence.records.values() if r.report is not None]
    if (
        reports
        and m.evidence.budget < reports[0].argument_bytes + reports[0].output_bytes
    ):
        return []  # every checkpoint needs the arguments and outputs
    estimates = sorted(
        (m.schedule_time(c, flops), i, c)
        for i, (c, flops) in enumerate(m.prices.schedules)
    )
    return [e for e in estimates if pick is None or e[0] < pick.time_s]


def _schedule(
    m: CostModel, cheaper: Sequence[tuple], pick: FrontierPoint | None
) -> Request | FrontierPoint | None:
    """What to confirm next of the `cheaper` schedules (compiled, then timed,
    fastest first), or the answer: the first that fits and, timed, still
    beats `pick`; else `pick`."""
    ev = m.evidence
    for estimate, _, c in cheaper:
        if m.floor(c) > ev.budget:
            continue
        if c not in ev.records:
            return Compile(c, None, "a schedule estimated faster than the pick")
        if not ev.fits(ev.records[c]):
            continue
        if c not in ev.offered:
            return Time((c,))
        point = m.compiled_point(c, estimate)
        if pick is None or point.time_s < pick.time_s:
            return point
    return pick


def _race(
    bench: Bench,
    problem: Problem,
    model: Callable[[Evidence], CostModel],
    ev: Evidence,
    pick: FrontierPoint,
    swaps: list[Swap],
) -> tuple[FrontierPoint, list[Swap], Evidence]:
    """`pick` against its rivals, the options that fit, are not a mix and were
    timed within 3% of the fastest of them: the fastest. Timings that close
    are within the noise of the rounds that ranked them, so where what is
    left of this call's compile time covers a warm-up and two rounds, the
    pick and as many rivals as it covers (at most three) are run round-robin
    again (once per plan cache); otherwise the plan's own rounds decide. A
    pick not timed yet (a mix) is always run, with one rival at least: it is
    measured before it is returned."""
    c0 = pick.checkpoint
    if c0 not in ev.runnable:
        return pick, swaps, ev
    measured = c0 in ev.timings
    fitting = sorted(
        (
            c
            for c, r in ev.records.items()
            if ev.fits(r)
            and not isinstance(c, ranges)
            and c in ev.timings
            and c in ev.runnable
        ),
        key=lambda c: ev.timings[c].seconds,
    )
    step = ev.timings[c0].seconds if measured else pick.time_s
    rivals, n = close_rivals(ev, c0, step, fitting)
    if not rivals:
        if not measured:  # nothing to race: timed beside the plan's clock
            ev = answer(bench, problem, ev, Time((c0,)))
        seconds, measured = model(ev).time_s(c0, pick.time_s)
        return pick._replace(time_s=seconds, measured=measured), swaps, ev
    run = [c0, *rivals[: max(n, 1)]]
    race, seconds = bench.race(problem, run, ev, go=n > 0 or not measured)
    ev = ev.raced(race, seconds)
    if race.timings is None:
        timings = [ev.timings[c] for c in run]
        how = "no time left to race the pick (the plan's rounds decide)"
    else:
        timings = list(race.timings)
        how = "raced the pick"
        bench.say(
            f"raced {len(run)} programs in {timings[0].rounds} rounds; {spent(ev)}"
        )
    k = min(range(1, len(run)), key=lambda i: timings[i].seconds)
    ratio = timings[0].seconds / timings[k].seconds
    bench.say(
        f"{how}: {ratio:.3f}x the step time of {checkpoint_name(run[k])}, the "
        "fastest option that fits and is not a mix"
    )
    if ratio < 1.0:
        return pick._replace(time_s=timings[0].seconds, measured=True), swaps, ev
    best = model(ev).compiled_point(run[k], timings[k].seconds)
    best = best._replace(time_s=timings[k].seconds, measured=True)
    return best, [*swaps, Swap("race", pick, best, ratio)], ev


def close_rivals(
    ev: Evidence, first: Planned, first_s: float, timed: Sequence[Planned]
) -> tuple[list[Planned], int]:
    """`(rivals, n)`: of `timed` (timed, fastest first), those other than
    `first` timed within `RULED_OUT` of the fastest (at most three: timings
    that close are within the noise of the rounds that ranked them), and how
    many of them, beside `first` (a step of `first_s`), what is left of this
    call's compile time covers a warm-up and two rounds of."""
    if not timed:
        return [], 0
    bar = (1 + RULED_OUT) * ev.timings[timed[0]].seconds
    rivals = [c for c in timed if ev.timings[c].seconds <= bar and c != first][:3]
    step, n = first_s, 0
    for c in rivals:  # a warm-up and two rounds of each program raced
        step += ev.timings[c].seconds
        if 3 * step > ev.left_s:
            break
        n += 1
    return rivals, n


def _nothing_fits(
    bench: Bench, problem: Problem, ev: Evidence, model: Callable[[Evidence], CostModel]
) -> None:
    """Compile the schedules whose floor is below the least memory compiled
    (so that the error names the smallest memory there is), then raise
    `NothingFits`."""
    m = model(ev)
    assert m.prices is not None
    least = min(
        (r.report.total_bytes for r in ev.records.values() if r.report), default=None
    )
    lightest = [c for c, _ in m.prices.schedules if least is None or m.floor(c) < least]
    ev = settle(
        bench,
        problem,
        ev,
        lambda ev: next(
            (
                Compile(c, None, "nothing fits: a schedule that may need less")
                for c in lightest
                if c not in ev.records
            ),
            None,
        ),
    )
    ev = settle(bench, problem, ev, lambda ev: _ask_prices(model(ev), list(ev.records)))
    m = model(ev)
    entries = [m.entry(r, m.roofline(c)) for c, r in ev.records.items()]
    raise_nothing_fits(entries, ev.budget, target_name(bench, ev))


def _ask_prices(m: CostModel, cs: Sequence[Planned]) -> Request | None:
    """The first of `cs` whose roofline needs tracing."""
    return next((Trace(c) for c in cs if not m.priced(c)), None)


def target_name(bench: Bench, ev: Evidence) -> str:
    for r in ev.records.values():
        if r.report is not None:
            return r.report.target
    return bench.target.label


# --- candidates ---------------------------------------------------------------------


def compare(
    bench: Bench, problem: Problem, asked: int, candidates: Sequence[Planned]
) -> PlanResult:
    """Each of `candidates` compiled (and timed where the bench measures):
    the fastest that fits."""
    bench.say(
        f"compiling {len(candidates)} candidates for "
        f"{bench.target.name or bench.hardware.kind}"
    )
    model = _model(bench, problem, None)
    ev = bench.start(problem, asked)
    for c in candidates:
        ev = answer(bench, problem, ev, Compile(c))
    ev = answer(bench, problem, ev, Time(tuple(candidates)))
    untimed = [c for c in candidates if c not in ev.timings]
    ev = settle(bench, problem, ev, lambda ev: _ask_prices(model(ev), untimed))
    m = model(ev)
    table = [
        m.entry(ev.records[c], m.roofline(c) if c in untimed else 0.0)
        for c in candidates
    ]
    fitting = [e for e in table if e.fits]
    if not fitting:
        raise_nothing_fits(table, ev.budget, target_name(bench, ev))
    order = {id(e): i for i, e in enumerate(table)}
    chosen = min(
        fitting, key=lambda e: (e.time_s, e.flops, e.memory_bytes, order[id(e)])
    )
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
    """The result, `fits` against the budget the evidence ends with; the notes
    and the closing progress line said."""
    m = CostModel(prices, ev, bench.hardware)
    said = notes(bench, m, swaps)
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
        target_name(bench, ev),
        tuple(frontier),
        tuple(said),
        ev.compiles,
        seconds,
        ev.timed_s,
        estimate=bench.hardware.estimate_note(),
    )


def notes(bench: Bench, m: CostModel, swaps: Sequence[Swap]) -> list[str]:
    """What the user should know, from the evidence and the stages' answers:
    a budget over what one device holds, figures of an unknown device,
    stacks that cannot be mixed, mixes that did not fit, and picks replaced."""
    ev, out = m.evidence, []
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
    if m.prices is not None and len(set(m.prices.depths)) > 1:
        out.append(
            f"stacks of different depths ({', '.join(map(str, m.prices.depths))}) "
            "cannot share layer ranges: comparing uniform options only"
        )
    if m.prices is not None:
        out += m.prices.notes
    out += _mix_notes(m)
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
    """The mixes that did not fit, each with what it compiled to (of a
    function that was priced: only a solve compiles mixes)."""
    ev, out = m.evidence, []
    if m.prices is None:
        return out
    failed = ev.failed_mixes()
    for c in failed:
        (_, light), (_, heavy) = c.parts
        predicted = ev.predicted.get(c)
        out.append(
            f"{checkpoint_name(c)} was predicted to fit "
            f"({format_size(predicted or 0)}) but compiled to "
            f"{format_memory(ev.records[c])}: at most {m.fewest(c)} layers of "
            f"{checkpoint_name(heavy)} with {checkpoint_name(light)}"
        )
    if len(failed) >= MIX_TRIES:
        out.append(
            f"{len(failed)} mixes did not fit when compiled: XLA's memory is not "
            "the model's here; choosing among uniform options"
        )
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
    on = Target.of(target, "roofline_seconds")
    with warnings.catch_warnings(), on.traced():
        warnings.simplefilter("ignore", ReplicatedArgumentsWarning)
        bench = Bench(on, False)
        problem = Problem.of(fn, args, on)
        m = CostModel(
            bench.prices(problem), Evidence(2**62), bench.hardware, problem.share
        )
        parts = (
            [p for _, p in found[0].parts]
            if isinstance(found[0], ranges)
            else found[:1]
        )
        ev = m.evidence
        for c in parts:
            if not m.priced(c):
                ev = ev.with_price(c, bench.price(problem, c))
        return CostModel(m.prices, ev, bench.hardware, problem.share).roofline(found[0])

"""Planning a global batch: how many micro-batches, which loss chunking and which
checkpoint run it fastest within the budget (`plan(..., micro_batches=...,
loss_chunks=...)`): an outer loop over ways of running the batch, around the
planner's one loop (told once, in the tutorial *Fit a batch, not just a model*,
"Which combination"): the loop (`solve`) runs on one way in full
(`_solve_first`), each later way is tried with its pick (`_try`), and the best
of each way race (`_race_bests`). Every time is per global batch. With
`shard`, a way is on a mesh too (every split of the chips between data
parallelism and FSDP): ahead of time, each estimate adds what its chips send
each other (`CostModel.sent`)."""

import dataclasses
import functools
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple, SupportsIndex

import jax

from .._accumulate import accumulate, check_split
from .._inspect._compiled import Compiled
from .._inspect._memory import user_stacklevel
from .._schedules._checkpoint import Planned, checkpoint_name, map_loss_chunk_sizes
from .._schedules._uniform import recursive
from .._util import traceable
from .._validate import check_int
from ._bench import Bench, Problem
from ._cache import PlanCache
from ._cost import entry
from ._evidence import Evidence, is_mix
from ._loop import State, compiled, loop, models, notes, solve, timing, traced
from ._report import BatchOption, NothingFits, PlanResult, mesh_name
from ._thresholds import CLOSE_WAYS, FASTER_TRIES, MODEL_ERROR, RACED_WAYS


def batch_ways(
    args: tuple,
    micro_batches: Sequence[SupportsIndex] | None,
    loss_chunks: Sequence[SupportsIndex | None] | None,
    in_axes: Any,
) -> list[tuple[int, int | None]]:
    """The (micro-batches, loss chunk size) pairs to compare, fewest
    micro-batches first, loss chunks in the order given (unplanned: the
    model's own, or `None`), each count checked against the batch."""
    fn = "eqx_remat.plan"
    ks = [1]
    if micro_batches is not None:
        if not micro_batches:
            raise ValueError(
                f"{fn} expected micro_batches to be a non-empty sequence of ints "
                f">= 1 (the counts to compare). Got {micro_batches!r}."
            )
        ks = sorted({check_int(fn, "micro_batches", k, 1) for k in micro_batches})
        for k in ks:
            check_split(args, k, in_axes)
    found = map_loss_chunk_sizes(args, lambda c: c)[1]
    chunks: list[int | None] = [found[0] if found else None]
    if loss_chunks is not None:
        if not found:
            raise ValueError(
                f"{fn} expected arguments containing a module with a "
                "`loss_chunk_size` field (a zoo.Transformer) to plan loss_chunks "
                "for. Got none."
            )
        if not loss_chunks:
            raise ValueError(
                f"{fn} expected loss_chunks to be a non-empty sequence of ints "
                f">= 1 or None (whole logits). Got {loss_chunks!r}."
            )
        chunks = list(
            dict.fromkeys(
                None if c is None else check_int(fn, "loss_chunks", c, 1)
                for c in loss_chunks
            )
        )
    return [(k, c) for k in ks for c in chunks]


Ways = list[tuple[int, int | None, Any]]
"""`(micro-batches, loss chunk size, mesh)`: the ways to run the batch (the
mesh `None`: the arguments as placed)."""


def warn_if_chunks_do_nothing(fn, args: tuple, ways: Ways) -> None:
    """Warn where `fn`'s program is the same at two of the loss chunk sizes
    (`fn` does not call the model's `loss`)."""
    found = map_loss_chunk_sizes(args, lambda c: c)[1]
    sizes = list(dict.fromkeys([found[0], *(c for _, c, _ in ways)]))[:2]
    if len(sizes) < 2:
        return

    def program(c: int | None) -> str:
        f, dynamic = traceable(fn, map_loss_chunk_sizes(args, lambda _: c)[0])
        return str(jax.make_jaxpr(f)(dynamic))

    a, b = sizes
    if program(a) == program(b):
        warnings.warn(
            f"plan(loss_chunks=...): the function's program is the same at "
            f"loss_chunk_size={a!r} and {b!r}, so loss_chunks changes nothing. "
            "A model's loss_chunk_size acts where the function calls its `loss` "
            "(zoo.Transformer.loss), not its `__call__`.",
            stacklevel=user_stacklevel(),
        )


class _Way(NamedTuple):
    """One way of running the batch: `k` micro-batches, loss chunk `c`, on
    `mesh` (`None`: as placed)."""

    k: int
    c: int | None
    problem: Problem
    mesh: Any = None

    @property
    def key(self) -> tuple:
        return self.k, self.c, self.mesh

    def __str__(self) -> str:
        on = "" if self.mesh is None else f", mesh={mesh_name(self.mesh)}"
        return f"micro_batches={self.k}, loss_chunk_size={self.c}{on}"


class _Best(NamedTuple):
    """A way's fastest checkpoint found that fits, and its evidence."""

    way: _Way
    checkpoint: Planned
    time_s: float
    measured: bool
    evidence: Evidence


def plan_batches(
    bench: Bench,
    fn,
    args: tuple,
    budget: int,
    ways: Ways,
    in_axes: Any,
    shard: Any = None,
) -> PlanResult:
    """`plan` over the ways `ways`: the fastest per global batch (a way on a
    mesh: `shard(mesh)`'s function and arguments)."""
    measuring = bench.measure  # chosen once
    placed: dict[Any, tuple] = {}  # each mesh's function and arguments, once

    def way(k: int, c: int | None, mesh: Any) -> _Way:
        f, a = fn, args
        if mesh is not None:
            if mesh not in placed:
                placed[mesh] = shard_on(shard, mesh)
            f, a = placed[mesh]
        f, a = _variant(f, a, k, c, in_axes, bench.cache)
        return _Way(k, c, Problem.of(f, a, bench.target), mesh)

    first, result, tried = _solve_first(bench, ways, way, budget)
    solved, bests = first.way, [first]
    for k, c, mesh in ways[ways.index(solved.key) + 1 :]:
        w = way(k, c, mesh)
        bench.say(f"trying {w}")
        best, ev, first = _try(bench, w, first, budget)
        if best is None:
            tried.append(ev)
        else:
            bests.append(best)
    bests[0] = first
    bests.sort(key=lambda b: b.time_s)
    # The roofline does not see what a smaller micro-batch costs a chip (a
    # matmul too small to keep it busy): within `CLOSE_WAYS` of the least
    # estimate, the fewest micro-batches.
    close = [b for b in bests if b.time_s <= (1 + CLOSE_WAYS) * bests[0].time_s]
    pick = bests[0] if measuring else min(close, key=lambda b: b.way.k)
    if measuring and len(bests) > 1:
        pick, took = _race_bests(bench, bests, solved, tried)
        same = lambda b: (b.way.key, b.checkpoint) == (pick.way.key, pick.checkpoint)
        bests = sorted((pick if same(b) else b for b in bests), key=lambda b: b.time_s)
        i = next(i for i, b in enumerate(bests) if b.way.key == solved.key)
        ev = bests[i].evidence.timed({}, took)
        bests[i] = bests[i]._replace(evidence=ev)
        pick = next(b for b in bests if same(b))
    return _batch_result(bench, result, pick, bests, tried, in_axes, first)


def shard_on(shard: Any, mesh: Any) -> tuple:
    """`shard(mesh)`: a function and its arguments, checked."""
    out = shard(mesh)
    if not (isinstance(out, tuple) and len(out) == 2 and callable(out[0])):
        raise ValueError(
            "plan expected shard(mesh) to return (fn, args): the function and a "
            f"tuple of its arguments, placed on the mesh. Got {out!r:.200}."
        )
    fn, args = out

    @functools.wraps(fn)
    def on_mesh(*args: Any) -> Any:
        # Traced on `mesh`, whatever the target's: code that asks which mesh
        # it runs on (zoo's flash attention) sees this one.
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    return on_mesh, tuple(args)


def _batch_result(bench, result, pick, bests, tried, in_axes, first) -> PlanResult:
    evidence = [b.evidence for b in bests] + list(tried)
    ev = pick.evidence
    chosen = entry(ev, ev.records[pick.checkpoint], pick.time_s, pick.measured)
    seconds = bench.say.elapsed()
    bench.say(
        f"done: {pick.way}, checkpoint={checkpoint_name(pick.checkpoint)}, "
        f"{seconds:.1f} s"
    )
    options = [
        BatchOption(
            b.way.k,
            b.way.c,
            b.checkpoint,
            b.evidence.records[b.checkpoint].memory_bytes or 0,
            b.time_s,
            b.measured,
            b.way.mesh,
        )
        for b in bests
    ]
    said = [*result.notes]
    default = next((b for b in bests if b.way.key == first.way.key), None)
    if pick.way.mesh is not None and default is not None and default is not pick:
        how = "measured" if pick.measured and default.measured else "estimated"
        a, b = pick.way, default.way
        if (a.k, a.c) == (b.k, b.c):
            a, b = mesh_name(a.mesh), mesh_name(b.mesh)
        said.append(
            f"{a} is {how} {default.time_s / pick.time_s:.2f}x as fast as {b} "
            f"(with {checkpoint_name(default.checkpoint)})"
        )
    for e in evidence:
        said += notes(bench, e, None)
    return dataclasses.replace(
        result,
        checkpoint=pick.checkpoint,
        entry=chosen,
        budget_bytes=min(e.budget for e in evidence),
        notes=tuple(dict.fromkeys(said)),
        compiles=sum(e.compiles for e in evidence),
        seconds=seconds,
        timed_seconds=sum(e.timed_s for e in evidence),
        micro_batches=pick.way.k,
        loss_chunk_size=pick.way.c,
        in_axes=in_axes,
        batches=tuple(options),
        mesh=pick.way.mesh,
    )


def _variant(fn, args: tuple, k: int, c: int | None, in_axes: Any, cache: PlanCache):
    """The function and arguments of `k` micro-batches and loss chunk `c`
    (`accumulate(fn, k)` kept in the plan cache, for later plans to find)."""
    if k > 1:
        fn = cache.get(
            fn,
            ("accumulate", id(fn), k, repr(in_axes)),
            lambda: accumulate(fn, k, in_axes=in_axes),
        )
    if map_loss_chunk_sizes(args, lambda c: c)[1]:
        args = map_loss_chunk_sizes(args, lambda _: c)[0]
    return fn, args


def _solve_first(
    bench: Bench, ways, way, budget: int
) -> tuple[_Best, PlanResult, list[Evidence]]:
    """Solve, in full, the first way for which something fits (its best and
    result), with the evidence of the ways passed over: those where the
    lightest options both need more than the budget and `MODEL_ERROR` (the
    last is solved, to say what fits nowhere). Within it, another option
    can need a little less than both (`save_names('mlp_hidden')` 1% less than
    `"nothing"` on a 2-layer transformer)."""
    tried: list[Evidence] = []
    for i, (k, c, mesh) in enumerate(ways):
        w = way(k, c, mesh)
        probe = None
        if i < len(ways) - 1:
            why = "a lightest option: whether anything fits this combination"
            light = compiled([(recursive(), None), ("nothing", None)], why)
            st = State(bench.start(w.problem, budget))
            model = models(bench, w.problem, None)
            probe = loop(bench, w.problem, model, st, [light]).evidence
            if not any(_near(r, probe.budget) for r in probe.records.values()):
                bench.say(f"nothing fits with {w}")
                tried.append(probe)
                continue
        bench.say(f"solving {w} in full")
        try:
            r, ev = solve(bench, w.problem, budget)
        except NothingFits as e:
            if i == len(ways) - 1:
                tried_ = ", ".join(dict.fromkeys(f"{k}/{c}" for k, c, _ in ways))
                raise NothingFits(
                    f"{e}\n(With the last of the micro-batch counts and loss "
                    f"chunk sizes tried: {tried_}.)"
                ) from None
            bench.say(f"nothing fits with {w}")
            if probe is not None:
                tried.append(probe)
            continue
        # The probe's compiles count too: its records are the solve's first.
        if probe is not None:
            ev = dataclasses.replace(ev, fresh={**probe.fresh, **ev.fresh})
        return _Best(w, r.checkpoint, r.entry.time_s, r.entry.measured, ev), r, tried
    raise AssertionError("unreachable")


def _near(record: Compiled, budget: int) -> bool:
    """Whether `record` compiled within the budget and `MODEL_ERROR`."""
    limit = (1 + MODEL_ERROR) * budget
    return record.report is not None and record.report.total_bytes <= limit


def _times(
    bench: Bench, problem: Problem, ev: Evidence, cs: Sequence[Planned], prices=None
) -> tuple[Evidence, dict[Planned, tuple[float, bool]]]:
    """`cs`' times: measured where they ran, else the roofline's (tracing what
    it needs priced)."""
    model = models(bench, problem, prices)
    ev = loop(bench, problem, model, State(ev), [traced(cs)]).evidence
    m = model(ev)
    return ev, {c: m.time_s(c) for c in cs}


def _try(
    bench: Bench, way: _Way, first: _Best, budget: int
) -> tuple[_Best | None, Evidence, _Best]:
    """`(best, evidence, first)`: `way`'s fastest fitting option among the
    solved pick and up to `FASTER_TRIES` other options compiled where solved,
    fastest first, whose memory, scaled as the pick's, fits (faster than the
    pick, where it fits here; none where XLA refused it); `way`'s evidence;
    and `first` with the prices its evidence learnt."""
    solved, model = first.evidence, models(bench, way.problem, None)
    before = solved.records[first.checkpoint].memory_bytes
    pick = compiled([(first.checkpoint, before)], "the solved combination's pick")
    st = loop(
        bench, way.problem, model, State(bench.start(way.problem, budget)), [pick]
    )
    record = st.evidence.records[first.checkpoint]
    # Refused: XLA's figure, where it gives one, bounds the memory; no scale.
    if record.report is None or before is None:
        return None, st.evidence, first
    fits = st.evidence.fits(record)
    ok = [
        c for c, r in solved.records.items() if r.report is not None and not is_mix(c)
    ]
    prices = bench.prices(first.way.problem)
    solved, times = _times(bench, first.way.problem, solved, ok, prices)
    first = first._replace(evidence=solved)
    ranked = sorted(
        (c for c in times if c != first.checkpoint), key=lambda c: times[c][0]
    )
    if fits:
        ranked = [c for c in ranked if times[c][0] < first.time_s]
    scaled = [
        (c, m * record.report.total_bytes / before)
        for c in ranked
        if (m := solved.records[c].memory_bytes)
    ]
    todo = [(c, m) for c, m in scaled if m <= st.evidence.budget][:FASTER_TRIES]
    fitting = lambda ev: [c for c, r in ev.records.items() if ev.fits(r)]
    why = (
        "faster than the pick where solved; may fit here"
        if fits
        else "the pick does not fit here; the fastest option where solved that may"
    )
    stages = [compiled(todo, why, until_fits=True), timing(fitting)]
    ev = loop(bench, way.problem, model, st, stages).evidence
    if not fitting(ev):
        return None, ev, first
    ev, timed = _times(bench, way.problem, ev, fitting(ev))
    c = min(timed, key=lambda c: timed[c][0])
    return _Best(way, c, *timed[c], ev), ev, first


def _race_bests(
    bench: Bench, bests: list[_Best], solved: _Way, tried: Sequence[Evidence]
) -> tuple[_Best, float]:
    """`(pick, seconds)`: the fastest of the `RACED_WAYS` fastest bests, run
    round-robin on one clock (the fastest's) in what is left of every way's
    compile time: each way timed on a clock of its own, so all of them race."""
    run = [b for b in bests if b.checkpoint in b.evidence.runnable][:RACED_WAYS]
    if len(run) < 2:
        return bests[0], 0.0
    what = ("ways", *((*b.way.key, b.checkpoint) for b in run))
    left = float(sum(e.left_s for e in [b.evidence for b in bests] + list(tried)))
    timings, took = bench.race(
        solved.problem,
        what,
        lambda: [
            bench.program(b.way.problem, b.evidence.records[b.checkpoint]) for b in run
        ],
        left,
        (0, run[0].time_s),
    )
    assert timings is not None  # raced: `go`
    i = min(range(len(run)), key=lambda i: timings[i].seconds)
    bench.say(
        "raced the bests of "
        + "; ".join(map(str, (b.way for b in run)))
        + f": {run[i].way} fastest, {took:.1f} s"
    )
    return run[i]._replace(time_s=timings[i].seconds, measured=True), took

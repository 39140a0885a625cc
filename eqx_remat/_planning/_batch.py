"""Planning a global batch: how many micro-batches, which loss chunking and which
checkpoint run it fastest within the budget (`plan(..., micro_batches=...,
loss_chunks=...)`). The search is told once, in the tutorial *Fit a batch,
not just a model* ("Which combination"); its stages are `_solve_first` (one
combination in full), `_try` (each later one) and `_race` (the bests).

Every time is per global batch: `accumulate(fn, k)` runs all `k` micro-batches.
"""

import dataclasses
import time
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple, SupportsIndex

import jax

from .._accumulate import accumulate, check_split
from .._inspect._memory import _user_stacklevel
from .._schedules._checkpoint import Checkpoint, map_loss_chunk_sizes
from .._schedules._ranges import ranges
from .._schedules._uniform import recursive
from .._util import traceable
from .._validate import check_int
from . import _cache
from ._clock import on_one_clock, time_interleaved, warm_up
from ._compiled import Compiled
from ._plan import _MODEL_ERROR, _Planner, _Progress
from ._report import BatchOption, NothingFits, PlanResult, _name


class _Way(NamedTuple):
    """One combination: `k` micro-batches, loss chunk `c`, and the planner of
    the function and arguments that run it."""

    k: int
    c: int | None
    planner: _Planner


class _Best(NamedTuple):
    way: _Way
    checkpoint: Checkpoint
    time_s: float
    measured: bool


def combinations(
    args: tuple,
    micro_batches: Sequence[SupportsIndex] | None,
    loss_chunks: Sequence[SupportsIndex | None] | None,
    in_axes: Any,
) -> list[tuple[int, int | None]]:
    """The (micro-batches, loss chunk size) pairs to compare, fewest
    micro-batches first, loss chunks in the order given (unplanned: the
    model's own, or `None` where it has no loss head field). Each count is
    checked against the batch now, as `accumulate` would check it."""
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


def warn_if_chunks_do_nothing(
    fn, args: tuple, ways: list[tuple[int, int | None]]
) -> None:
    """Warn where `fn`'s program is the same at two of the loss chunk sizes it
    is planned for (or the model's own): they change nothing, since `fn` does
    not call the model's `loss`."""
    found = map_loss_chunk_sizes(args, lambda c: c)[1]
    sizes = list(dict.fromkeys([found[0], *(c for _, c in ways)]))[:2]
    if len(sizes) < 2:
        return

    def program(c: int | None) -> str:
        f, dynamic = traceable(*_variant(fn, args, 1, c, None))
        return str(jax.make_jaxpr(f)(dynamic))

    a, b = sizes
    if program(a) == program(b):
        warnings.warn(
            f"plan(loss_chunks=...): the function's program is the same at "
            f"loss_chunk_size={a!r} and {b!r}, so loss_chunks changes nothing. "
            "A model's loss_chunk_size acts where the function calls its `loss` "
            "(zoo.Transformer.loss), not its `__call__`.",
            stacklevel=_user_stacklevel(),
        )


def plan_batches(
    fn,
    args: tuple,
    budget: int,
    target: str | None,
    measure: bool,
    say: _Progress,
    ways: list[tuple[int, int | None]],
    in_axes: Any,
) -> PlanResult:
    """`plan` over the combinations `ways`: the fastest per global batch."""

    made: list[_Planner] = []  # every planner, for the counts

    def planner(k: int, c: int | None, solving: bool) -> _Planner:
        f, a = _variant(fn, args, k, c, in_axes)
        made.append(_Planner(f, a, budget, target, measure, say, solving))
        return made[-1]

    solved, result = _solve_first(ways, planner, say)
    bests = [
        _Best(solved, result.checkpoint, result.entry.time_s, result.entry.measured)
    ]
    for k, c in ways[ways.index((solved.k, solved.c)) + 1 :]:
        say(f"trying micro_batches={k}, loss_chunk_size={c}")
        best = _try(_Way(k, c, planner(k, c, False)), solved, bests[0])
        if best is not None:
            bests.append(best)
    bests.sort(key=lambda b: b.time_s)
    # The roofline does not see what a smaller micro-batch costs a chip (a
    # matmul too small to keep it busy): within 1% of the least estimate, the
    # fewest micro-batches.
    close = [b for b in bests if b.time_s <= 1.01 * bests[0].time_s]
    pick = bests[0] if measure else min(close, key=lambda b: b.way.k)
    if measure and len(bests) > 1:
        pick = _race(bests, solved)
        same = lambda b: (b.way, b.checkpoint) == (pick.way, pick.checkpoint)
        bests = sorted((pick if same(b) else b for b in bests), key=lambda b: b.time_s)
    p = pick.way.planner
    entry = p.entry(p.compiled[pick.checkpoint], pick.time_s)._replace(
        time_s=pick.time_s, measured=pick.measured
    )
    seconds = say.elapsed()
    say(
        f"done: micro_batches={pick.way.k}, loss_chunk_size={pick.way.c}, "
        f"checkpoint={_name(pick.checkpoint)}, {seconds:.1f} s"
    )
    options = [
        BatchOption(
            b.way.k,
            b.way.c,
            b.checkpoint,
            b.way.planner.compiled[b.checkpoint].memory_bytes or 0,
            b.time_s,
            b.measured,
        )
        for b in bests
    ]
    return dataclasses.replace(
        result,
        checkpoint=pick.checkpoint,
        entry=entry,
        budget_bytes=min(q.budget for q in made),
        notes=tuple(dict.fromkeys(n for q in made for n in q.notes)),
        compiles=sum(q.compiles for q in made),
        seconds=seconds,
        timed_seconds=sum(q.timed_s for q in made),
        micro_batches=pick.way.k,
        loss_chunk_size=pick.way.c,
        in_axes=in_axes,
        batches=tuple(options),
    )


def _variant(fn, args: tuple, k: int, c: int | None, in_axes: Any):
    """The function and arguments of `k` micro-batches and loss chunk `c`:
    `accumulate(fn, k)` (one per function and `k`, kept in the plan cache,
    so that later plans find what this one compiled), arguments whose
    `loss_chunk_size` fields are `c`."""
    if k > 1:
        fn = _cache.CACHE.get(
            fn,
            ("accumulate", id(fn), k, repr(in_axes)),
            lambda: accumulate(fn, k, in_axes=in_axes),
        )
    if map_loss_chunk_sizes(args, lambda c: c)[1]:
        args = map_loss_chunk_sizes(args, lambda _: c)[0]
    return fn, args


def _solve_first(ways, planner, say) -> tuple[_Way, PlanResult]:
    """Solve, in full, the first combination for which something fits: where
    the lightest options (`recursive()`, `"nothing"`) both need more than
    the budget plus the model's error, the combination is passed over after two
    compiles (the last one is solved, to say what fits nowhere). Within that,
    it is solved: another option can need a little less than both (on a
    2-layer transformer, `save_names('mlp_hidden')` 1% less than
    `"nothing"`: it spares the backward pass a recomputed buffer)."""
    for i, (k, c) in enumerate(ways):
        last = i == len(ways) - 1
        probe = None if last else planner(k, c, False)
        if probe is not None and not any(
            _near(probe.compile(light), probe.budget)
            for light in (recursive(), "nothing")
        ):
            say(f"nothing fits with micro_batches={k}, loss_chunk_size={c}")
            continue
        say(f"solving micro_batches={k}, loss_chunk_size={c} in full")
        p = planner(k, c, True)
        try:
            return _Way(k, c, p), p.solve()
        except NothingFits as e:
            if i == len(ways) - 1:
                tried = ", ".join(f"{k}/{c}" for k, c in ways)
                raise NothingFits(
                    f"{e}\n(With the last of the micro-batch counts and loss "
                    f"chunk sizes tried: {tried}.)"
                ) from None
            say(f"nothing fits with micro_batches={k}, loss_chunk_size={c}")
    raise AssertionError("unreachable")


def _near(record: Compiled, budget: int) -> bool:
    """Whether `record` compiled within the budget plus the model's error
    (`_MODEL_ERROR`): another option may then fit."""
    limit = (1 + _MODEL_ERROR) * budget
    return record.report is not None and record.report.total_bytes <= limit


def _try(way: _Way, solved: _Way, pick: _Best) -> _Best | None:
    """`way`'s fastest fitting option among the solved pick and up to two of
    the options faster than it (on the solved combination's clock), fastest
    first, where their memory, scaled as the pick's scaled, fits."""
    p, s = way.planner, solved.planner
    before = s.compiled[pick.checkpoint].memory_bytes
    record = p.compile(pick.checkpoint, before)
    if record.memory_bytes is None or before is None:
        return None
    scale = record.memory_bytes / before
    faster = sorted((t, c) for c, t in _times(s).items() if t < pick.time_s)
    tried = 0
    for _, c in faster:
        memory = s.compiled[c].memory_bytes
        if tried == 2 or memory is None or memory * scale > p.budget:
            continue
        tried += 1
        if p._fits(p.compile(c, memory * scale)):
            break
    fitting = [c for c, r in p.compiled.items() if p._fits(r)]
    if not fitting:
        return None
    if p.measure:
        p.time(fitting)
    timed = {c: p.time_s(c, p.roofline(c)) for c in fitting}
    c = min(timed, key=lambda c: timed[c][0])
    return _Best(way, c, *timed[c])


def _times(p: _Planner) -> dict[Checkpoint, float]:
    """The solved combination's time for each compiled option that is not a
    mix, measured where it ran, else the roofline's."""
    return {
        c: p.time_s(c, p.roofline(c))[0]
        for c, r in p.compiled.items()
        if r.report is not None and not isinstance(c, ranges)
    }


def _race(bests: list[_Best], solved: _Way) -> _Best:
    """The four fastest bests, run round-robin on one clock (the solved
    combination's): the fastest in those rounds. Each combination timed its
    programs on a clock of its own, at another moment and beside other
    programs, so how far apart two bests were timed says little: every one
    of the four races, not only those close to the fastest."""
    run = [b for b in bests if b.way.planner.runnable(b.checkpoint)][:4]
    if len(run) < 2:
        return bests[0]
    programs = [b.way.planner._program(b.checkpoint) for b in run]
    key = solved.planner._k(
        "batch-race", tuple((b.way.k, b.way.c, b.checkpoint) for b in run)
    )

    def measure():
        """After a warm-up, 2 to 31 rounds: as many as fit in what is left of
        the compile time of every combination planned (each was timed on its
        own clock: the race puts the bests on one)."""
        start = time.perf_counter()
        warm = warm_up(programs)
        done = {id(b.way.planner): b.way.planner for b in bests}.values()
        left = sum(q.left_s() for q in done) - warm
        out = time_interleaved(programs, rounds=31, warmup=False, seconds=left)
        took = time.perf_counter() - start
        solved.planner.timed_s += took
        solved.planner.say(
            f"raced {len(run)} combinations in {out[0].rounds} rounds, {took:.1f} s "
            f"({left + warm:.1f} s left of the compiles' time)"
        )
        return out

    timings = _cache.CACHE.get(solved.planner.fn, key, measure)
    timings = on_one_clock(timings, 0, run[0].time_s, by="faster_half")
    i = min(range(len(run)), key=lambda i: timings[i].seconds)
    solved.planner.say(
        "raced the bests of "
        + ", ".join(f"{b.way.k}/{b.way.c}" for b in run)
        + f" (micro-batches/loss chunk): {run[i].way.k}/{run[i].way.c} fastest"
    )
    return run[i]._replace(time_s=timings[i].seconds, measured=True)

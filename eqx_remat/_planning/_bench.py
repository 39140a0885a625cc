"""The planner's one effectful part (`Bench`): it traces, compiles, runs, times
and races programs, and remembers what it learnt between calls (in one
`PlanCache`). What it returns is a record to fold into an `Evidence`; it keeps
no record of a call. A test hands the loop a bench of fakes."""

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from .._inspect._clock import (
    Timing,
    concrete,
    device_memory_bytes,
    on_one_clock,
    time_interleaved,
    warm_up,
)
from .._inspect._compiled import Compiled, Program, compile_program
from .._inspect._memory import unpaid_offload
from .._inspect._targets import Target, share_per_chip
from .._roofline import Price, price, stacks_of
from .._schedules._checkpoint import Planned, set_checkpoint
from .._util import split_args
from . import _cache
from ._cache import PlanCache, cache_key
from ._evidence import Evidence, is_mix
from ._prices import Prices, price_function
from ._report import Progress
from ._thresholds import RACE_ROUNDS, RULED_OUT, TIME_ROUNDS


class Problem(NamedTuple):
    """One function and its arguments: `key`, their cache key (`None`: not
    hashable, nothing remembered), and `share`, the part of the activations
    one chip holds."""

    fn: Callable[..., Any]
    args: tuple
    key: Any
    share: float

    @staticmethod
    def of(fn: Callable[..., Any], args: tuple, target: Target) -> "Problem":
        share = share_per_chip(args, target.chips)
        return Problem(fn, args, cache_key(fn, args, target.name), share)

    def k(self, *what: Any) -> Any:
        """The cache key of `what`, for this function and arguments."""
        return None if self.key is None else (self.key, *what)


class Timed(NamedTuple):
    """A timing's new step times, the seconds it took, and its rounds (least,
    most, how many ran the most)."""

    timings: dict[Planned, Timing]
    seconds: float
    rounds: tuple[int, int, int] = (0, 0, 0)


def still_open(
    timings: Sequence[Timing], memory: Sequence[int], *, always: int | None = None
) -> list[int]:
    """The indices of the programs no other beats by more than `RULED_OUT` in
    step time (their faster halves) needing no more `memory`: their place on
    the time-memory frontier is still open (`always`'s whatever its time)."""
    fast = [t.faster_half for t in timings]
    return [
        i
        for i in range(len(timings))
        if i == always
        or not any(
            memory[j] <= memory[i] and fast[j] * (1 + RULED_OUT) < fast[i]
            for j in range(len(timings))
            if j != i
        )
    ]


def compile_checkpoint(
    fn: Callable, args: tuple, c: Planned, target: str | None, *, runnable: bool
) -> Compiled:
    """Compile `fn(*args)` with every checkpoint field of `args` set to `c`, for
    `target`; `runnable`: keep the executable (the device at hand)."""
    return compile_program(fn, set_checkpoint(args, c), c, target, runnable)


class Bench:
    """Compiles and runs programs for one `target`, times them where `measure`
    (the device at hand), and remembers in `cache` (by default the one
    [`eqx_remat.clear_plan_cache`][] empties). `clock` (as `time_interleaved`),
    `warm` (as `warm_up`), `free_memory` and `compile` (as
    `compile_checkpoint`) may be replaced, e.g. by a test's fakes."""

    def __init__(
        self,
        target: Target,
        measure: bool,
        *,
        say: Progress | None = None,
        cache: PlanCache | None = None,
        clock: Callable[..., list[Timing]] = time_interleaved,
        warm: Callable[[Sequence[Callable[[], Any]]], float] = warm_up,
        free_memory: Callable[[], int | None] = device_memory_bytes,
        compile: Callable[..., Compiled] = compile_checkpoint,
    ):
        self.target = target
        self.measure = measure
        self.say = Progress(False) if say is None else say
        self.cache = _cache.CACHE if cache is None else cache
        self.clock, self.warm, self.free_memory = clock, warm, free_memory
        self.compile_fn = compile
        self.hardware, self.known = target.hardware()
        # Arrays to run programs on, made once per problem (at its first run).
        self.inputs: dict[Any, list] = {}

    def capacity(self) -> int | None:
        """What one device holds: the device's limit (not what is free: the same
        on every process), what XLA lets a program use of a target's chip, or
        `None` for the host's memory."""
        if self.target.name is not None:
            return self.hardware.capacity_bytes
        if jax.default_backend() == "cpu":
            return None
        return device_memory_bytes(free=False)

    # --- tracing -----------------------------------------------------------------

    def prices(self, problem: Problem) -> Prices:
        """`problem`'s stacks and per-layer options, priced once."""
        return self.cache.get(
            problem.fn,
            problem.k("prices"),
            lambda: price_function(
                problem.fn,
                problem.args,
                self.stacks(problem),
                self.hardware,
                problem.share,
                self.say,
                check=functools.partial(self.unpaid_offload, problem),
            ),
        )

    def unpaid_offload(self, problem: Problem, c: Planned) -> str | None:
        """Why offloading checkpoint `c` does not pay (compiled beside its
        save-on-device twin, as `memory_report` does), or `None`. `c`'s own
        compile is kept for `compile`: the search compiles it too, as a rule
        (an offloading option is the lightest)."""
        record = self.cache.get(
            problem.fn,
            problem.k("checked", c),
            lambda: self.compile_fn(
                problem.fn, problem.args, c, self.target.name, runnable=self.measure
            ),
        )
        if record.report is None:  # does not fit one device: nothing to check
            return None
        args = set_checkpoint(problem.args, c)
        unpaid = unpaid_offload(record.report, problem.fn, args, self.target.name)
        return None if unpaid is None else unpaid[1]

    def stacks(self, problem: Problem) -> list[tuple[str, int]]:
        """`(path, depth)` of each run of a stack `problem` differentiates, in
        the order it runs them (`stacks_of`, traced once)."""
        return self.cache.get(
            problem.fn,
            problem.k("stacks"),
            lambda: stacks_of(problem.fn, problem.args),
        )

    def price(self, problem: Problem, c: Planned) -> Price:
        """`c` priced by tracing (once)."""
        depths = frozenset(d for _, d in self.stacks(problem))
        return self.cache.get(
            problem.fn,
            problem.k("price", c),
            lambda: price(problem.fn, problem.args, c, depths),
        )

    def start(
        self, problem: Problem, asked: int, options: Sequence[Planned] = ()
    ) -> Evidence:
        """The evidence a call starts from: the budget, what one device holds,
        the mixes earlier calls compiled (and raced), and the programs of
        `options` they compiled (`cached`)."""
        mixes = self.cache.get(problem.fn, problem.k("mixes"), dict)
        raced = tuple(
            c
            for c in mixes
            if self.cache.has(problem.fn, problem.k("time", c))
            and self.cache.has(problem.fn, problem.k("compiled", c))
        )
        ev = Evidence(
            asked, self.capacity(), earlier_mixes=dict(mixes), raced_mixes=raced
        )
        for c in options:
            record = self.cached(problem, c)
            if record is not None:
                ev = ev.compiled(record, None, None, self.runnable(record))
        return ev

    # --- compiling ---------------------------------------------------------------

    def cached(self, problem: Problem, c: Planned) -> Compiled | None:
        """`c`'s program as an earlier call compiled it, where it serves here
        (measuring, it has an executable)."""
        key = problem.k("compiled", c)
        if not self.cache.has(problem.fn, key):
            return None
        record = self.cache.get(problem.fn, key, lambda: None)
        if record is None or (
            self.measure and record.report is not None and record.executable is None
        ):
            return None
        return record

    def compile(self, problem: Problem, c: Planned) -> tuple[Compiled, float | None]:
        """`(record, seconds)`: `c` compiled (`seconds` it took), or taken from
        the cache (`seconds` is `None`)."""
        record = self.cached(problem, c)
        if record is not None:
            return record, None
        checked = problem.k("checked", c)  # compiled by the offload check
        if self.cache.has(problem.fn, checked):
            record = self.cache.get(problem.fn, checked, lambda: None)
        else:
            record = self.compile_fn(
                problem.fn, problem.args, c, self.target.name, runnable=self.measure
            )
        self.cache.put(problem.fn, problem.k("compiled", c), record)
        if is_mix(c) and record.report is not None:
            mixes = self.cache.get(problem.fn, problem.k("mixes"), dict)
            mixes = {**mixes, c: record.report.total_bytes}
            self.cache.put(problem.fn, problem.k("mixes"), mixes)
        return record, record.compile_s

    def runnable(self, record: Compiled | None) -> bool:
        """Whether `record` was compiled for the device at hand and fits what
        it has free."""
        if record is None or record.executable is None or record.report is None:
            return False
        free = self.free_memory()
        return free is None or record.report.total_bytes <= free

    def program(self, problem: Problem, record: Compiled) -> Program:
        """`record`'s program, ready to run on `problem`'s inputs."""
        inputs = self.inputs.get(problem.key)
        if inputs is None:
            dynamic = split_args(problem.args)[0]
            inputs = jax.tree.leaves(concrete(dynamic))
            self.inputs[problem.key] = inputs
        dynamic = split_args(set_checkpoint(problem.args, record.checkpoint))[0]
        return Program(record, jax.tree.unflatten(jax.tree.structure(dynamic), inputs))

    # --- timing --------------------------------------------------------------------

    def time(self, problem: Problem, cs: Sequence[Planned], ev: Evidence) -> Timed:
        """The step time of each of `cs` that can run here and has none in `ev`:
        from the cache, or measured round-robin beside the fastest program
        timed (one clock for the whole plan, by the faster halves of rounds),
        in at most `TIME_ROUNDS` rounds as what is left of the compile time
        allows, racing those `still_open`."""
        known: dict[Planned, Timing] = {}
        new = []
        for c in dict.fromkeys(cs):
            if c in ev.timings or c not in ev.runnable:
                continue
            key = problem.k("time", c)
            if self.cache.has(problem.fn, key):
                known[c] = self.cache.get(problem.fn, key, lambda: None)
            else:
                new.append(c)
        if not new:
            return Timed(known, 0.0)
        timings = {**ev.timings, **known}
        timed = [c for c in timings if c in ev.runnable]
        reference = min(timed, key=lambda c: timings[c].seconds) if timed else None
        run = new + ([reference] if reference is not None else [])
        programs = [self.program(problem, ev.records[c]) for c in run]
        memory = [ev.records[c].memory_bytes or 0 for c in run]
        pivot = len(run) - 1 if reference is not None else None
        start = time.perf_counter()
        warm = self.warm(programs)
        out = self.clock(
            programs,
            rounds=TIME_ROUNDS,
            warmup=False,
            seconds=ev.left_s - warm,
            keep=lambda ts: still_open(ts, memory, always=pivot),
        )
        took = time.perf_counter() - start
        most = max(t.rounds for t in out)
        if reference is not None:  # on the clock of the plan's earlier rounds
            out = on_one_clock(out, -1, timings[reference].seconds, by="faster_half")
        else:  # on the clock of the fastest program that ran every round
            raced = [i for i, t in enumerate(out) if t.rounds == most]
            fastest = min(raced, key=lambda i: out[i].faster_half)
            out = on_one_clock(out, fastest, by="faster_half")
        for c, t in zip(new, out):
            known[c] = t
            self.cache.put(problem.fn, problem.k("time", c), t)
        rounds = [t.rounds for t in out[: len(new)]]
        return Timed(known, took, (min(rounds), most, rounds.count(most)))

    def race(
        self,
        problem: Problem,
        what: Any,
        programs: Callable[[], Sequence[Program]],
        seconds: float,
        pivot: tuple[int, float],
        go: bool = True,
    ) -> tuple[tuple[Timing, ...] | None, float]:
        """`(timings, seconds taken)`: the `programs()` round-robin after a
        warm-up, 2 to `RACE_ROUNDS` rounds, as many as fit in `seconds`, on the
        clock of `pivot` (`(i, seconds)`: program `i`'s step time, by the
        faster halves); an earlier race of the same programs (`what`) from the
        cache; `None` where there is none and not `go`."""
        key = problem.k("race", what)
        if not go and not self.cache.has(problem.fn, key):
            return None, 0.0
        start = time.perf_counter()

        def measure() -> tuple[Timing, ...]:
            run = programs()
            warm = self.warm(run)
            return tuple(
                self.clock(
                    run, rounds=RACE_ROUNDS, warmup=False, seconds=seconds - warm
                )
            )

        timings = self.cache.get(problem.fn, key, measure)
        timings = tuple(on_one_clock(timings, *pivot, by="faster_half"))
        return timings, time.perf_counter() - start

    def keep(self, problem: Problem, timings: dict[Planned, Timing]) -> None:
        """Remember `timings` of `problem`'s programs (a race's)."""
        for c, t in timings.items():
            self.cache.put(problem.fn, problem.k("time", c), t)

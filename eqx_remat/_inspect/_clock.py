"""Timing compiled programs on the device at hand: the clock behind
[`eqx_remat.plan`][]'s measured step times (and the benchmarks'). Each round
runs every program once, in an order shuffled round by round, so that drift
hits every program alike; what means something is a ratio of two programs'
times from the same rounds (`on_one_clock`)."""

import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Timing(NamedTuple):
    """The step time of one program.

    **Attributes:**

    - `seconds`: the median over the rounds.
    - `spread`: the interquartile range of the rounds over the median (for
      fewer than 4 rounds, their range): how far one round strays.
    - `rounds`: how many timed runs.
    - `times`: each round's time, in order (for ratios taken round by
      round: [`eqx_remat.internal.paired_ratio`][]).
    """

    seconds: float
    spread: float
    rounds: int
    times: tuple[float, ...] = ()

    @property
    def faster_half(self) -> float:
        """The mean of the faster half of the rounds (of one round in two, two
        in three or four), `seconds` where the rounds were not recorded."""
        if not self.times:
            return self.seconds
        return statistics.fmean(sorted(self.times)[: (len(self.times) + 1) // 2])


def concrete(dynamic: Any, seed: int = 0) -> Any:
    """Arrays for the array leaves of `dynamic`: a `jax.ShapeDtypeStruct`
    becomes an array of its shape, dtype and sharding (small normal values for
    floating dtypes, else zeros: valid indices and token ids)."""
    key = jax.random.key(seed)

    def make(i: int, x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        sharding = getattr(x, "sharding", None)
        if jnp.issubdtype(x.dtype, jnp.floating):
            k = jax.random.fold_in(key, i)
            f = lambda: 0.02 * jax.random.normal(k, x.shape, x.dtype)
        else:
            f = lambda: jnp.zeros(x.shape, x.dtype)
        return jax.jit(f, out_shardings=sharding)()

    leaves, treedef = jax.tree.flatten(dynamic)
    return jax.tree.unflatten(treedef, [make(i, x) for i, x in enumerate(leaves)])


def device_memory_bytes(*, free: bool = True) -> int | None:
    """Memory one device of the default backend can give a program: what its
    allocator has free (`free`), or its limit; on the CPU, the host's
    available memory (`None`: not known)."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        if limit is None:
            return None
        return int(limit) - (int(stats.get("bytes_in_use", 0)) if free else 0)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return None


def run_once(program: Callable[[], Any]) -> float:
    """Run `program` once, to completion: the seconds it took."""
    start = time.perf_counter()
    jax.block_until_ready(program())
    return time.perf_counter() - start


def warm_up(programs: Sequence[Callable[[], Any]]) -> float:
    """Run each of `programs` once (a first run is not timed): the seconds."""
    start = time.perf_counter()
    for p in programs:
        run_once(p)
    return time.perf_counter() - start


def time_interleaved(
    programs: Sequence[Callable[[], Any]],
    *,
    rounds: int,
    warmup: bool = True,
    seconds: float = math.inf,
    keep: Callable[[list[Timing]], Sequence[int]] | None = None,
    run: Callable[[Callable[[], Any]], float] = run_once,
    now: Callable[[], float] = time.perf_counter,
) -> list[Timing]:
    """Time each of `programs` (callables that run one step) in up to `rounds`
    interleaved rounds, after one warm-up run each (`warmup`): their
    [`eqx_remat.internal.Timing`][]s, in order. Each round runs the programs
    in an order of its own (shuffled, the same on every call).

    Every program runs at least two rounds, and more while they fit in half
    of `seconds`; after that (a race), a round runs only where it fits in
    what is left of `seconds`, and only the programs `keep` returns the
    indices of, given their timings so far (one left out keeps the times of
    its first rounds; the race ends with one left). With neither, `rounds`
    rounds of every program. `run` runs a program once and says how long it
    took; `now` reads the clock that `seconds` is on."""
    if warmup:
        for p in programs:
            run(p)
    times: list[list[float]] = [[] for _ in programs]
    running = list(range(len(programs)))
    shuffle = random.Random(0).shuffle
    start = now()
    racing = False
    for r in range(rounds):
        if r >= 2:
            elapsed = now() - start
            next_round = sum(times[i][-1] for i in running)
            racing = racing or elapsed + next_round > seconds / 2
            if keep is not None and racing:
                kept = set(keep([timing(ts) for ts in times]))
                running = [i for i in running if i in kept]
                if len(running) < 2:  # nothing left to compare
                    break
                next_round = sum(times[i][-1] for i in running)
            if elapsed + next_round > seconds:
                break
        order = running.copy()
        shuffle(order)
        for i in order:
            times[i].append(run(programs[i]))
    return [timing(ts) for ts in times]


def timing(times: Sequence[float]) -> Timing:
    """The [`eqx_remat.internal.Timing`][] of the step times `times`."""
    median = statistics.median(times)
    if len(times) >= 4:
        q1, q3 = np.percentile(times, [25, 75])
        spread = float(q3 - q1)
    else:
        spread = max(times) - min(times)
    return Timing(
        median, spread / median if median > 0 else math.inf, len(times), tuple(times)
    )


def paired_ratio(a: Timing, b: Timing) -> float:
    """The median over rounds of `a`'s time over `b`'s in the same round, a
    ratio that drift between rounds does not move (the ratio of medians where
    the rounds were not recorded)."""
    if a.times and len(a.times) == len(b.times):
        return statistics.median(x / y for x, y in zip(a.times, b.times))
    return a.seconds / b.seconds


def on_one_clock(
    timings: Sequence[Timing],
    pivot: int,
    seconds: float | None = None,
    *,
    by: Literal["rounds", "faster_half"] = "rounds",
) -> list[Timing]:
    """`timings`, taken in the same interleaved rounds, each put on the clock of
    `timings[pivot]`: its time is the pivot's (or `seconds`, the pivot's time
    measured earlier) times its ratio to the pivot, by one statistic:

    - `by="rounds"`: the [`eqx_remat.internal.paired_ratio`][]: a round slow
      for every program moves no program's time.
    - `by="faster_half"`: the ratio of the means of their faster halves of
      rounds, the planner's: with few rounds on a busy machine, it ranks
      programs better (the tutorial's
      [How the planner solves][how-the-planner-solves], step 2).

    Each program's `times` are scaled as the pivot's are; one that ran fewer
    rounds (left out of a race) is held against the pivot's first rounds."""
    ref = timings[pivot]
    if by == "faster_half":
        base = ref.faster_half if seconds is None else seconds
        scale = base / ref.faster_half

        def on_clock(t: Timing) -> Timing:
            n = len(t.times)
            same = timing(ref.times[:n]) if 0 < n < len(ref.times) else ref
            return t._replace(
                seconds=base * t.faster_half / same.faster_half,
                times=tuple(x * scale for x in t.times),
            )

        return [on_clock(t) for t in timings]
    base = ref.seconds if seconds is None else seconds
    scale = base / ref.seconds
    return [
        t._replace(
            seconds=base * paired_ratio(t, ref),
            times=tuple(x * scale for x in t.times),
        )
        for t in timings
    ]

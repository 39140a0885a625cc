"""Compile a step, then time steps round-robin: how every benchmark that runs
steps times them (benchmarks/README.md, "How we measure"). A step is compiled
once (`compile_step`); the steps of a run are timed together, one warm-up run
each, then in interleaved rounds (`time_steps`): each step's time is the median
of its rounds, or its median ratio, round by round, to one step's (a baseline
timed in the same rounds).
"""

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax

import eqx_remat as er


@dataclasses.dataclass(frozen=True)
class Step:
    """One step, compiled: `run()` runs it once on its inputs."""

    run: Callable[[], Any]
    compiled: jax.stages.Compiled
    compile_s: float  # tracing, lowering and compiling

    def report(self, flops: int = 0) -> er.MemoryReport:
        """Its compiled memory (`eqx_remat.internal.compiled_report` on this
        backend), with `flops` as given."""
        return er.internal.compiled_report(
            self.compiled, flops=flops, target=jax.default_backend()
        )

    @property
    def memory_bytes(self) -> int:
        """Arguments, outputs and temporaries, compiled."""
        return self.report().total_bytes


def input_leaves(*args: Any) -> list:
    """Arrays for the array leaves of `args` (an array stays itself, a
    `jax.ShapeDtypeStruct` becomes an array: `eqx_remat.internal.concrete`), in
    their order: made once, so that steps compiled for the same arguments run
    on the same arrays (`compile_step(..., leaves=...)`)."""
    dynamic = eqx.filter(args, er.internal.is_array_like)
    return jax.tree.leaves(er.internal.concrete(dynamic))


def compile_step(fn: Callable, *args: Any, leaves: Sequence | None = None) -> Step:
    """`fn(*args)` compiled with `jax.jit`: the array leaves of `args` (arrays,
    whose shardings it keeps, or `jax.ShapeDtypeStruct`s) are its inputs, every
    other leaf (a module's functions, Python numbers) is fixed, as
    `eqx.filter_jit` does; the array leaves of what `fn` returns are its
    outputs. It runs on `leaves` (arrays for the array leaves of `args`, in
    their order: `input_leaves`), by default the array leaves of `args`
    themselves, which must then be arrays. A program that XLA refuses (it does
    not fit) raises its error."""
    dynamic, static = eqx.partition(args, er.internal.is_array_like)

    def step(dynamic: Any) -> Any:
        return eqx.filter(fn(*eqx.combine(dynamic, static)), eqx.is_array)

    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(dynamic).compile()
    compile_s = time.perf_counter() - t0
    if leaves is not None:
        dynamic = jax.tree.unflatten(jax.tree.structure(dynamic), leaves)
    return Step(functools.partial(compiled, dynamic), compiled, compile_s)


def time_steps(
    steps: Sequence[Step],
    rounds: int,
    *,
    on: int | Literal["fastest"] | None = None,
    warmup: bool = True,
    each_round: Callable[[int], None] | None = None,
) -> list[er.internal.Timing]:
    """Time `steps` together: one warm-up run each (`warmup`; `False` where the
    caller ran each once already), then `rounds` interleaved rounds, each in an
    order of its own (`eqx_remat.internal.time_interleaved`). Their
    `eqx_remat.internal.Timing`s, in order: each the median of its rounds, or,
    with `on` (an index, or `"fastest"`: the step of the least median), on
    that step's clock, its time its median ratio, round by round, to that
    step's (`eqx_remat.internal.on_one_clock`): a round slow for every step
    moves none. `each_round(r)` is called as round `r` (from 0) starts (with
    no steps too: a progress bar counts the rounds)."""
    if not steps:
        if each_round is not None:
            for r in range(rounds):
                each_round(r)
        return []
    if warmup:
        for s in steps:
            jax.block_until_ready(s.run())
    runs = 0

    def run(program: Callable[[], Any]) -> float:
        nonlocal runs
        if each_round is not None and runs % len(steps) == 0:
            each_round(runs // len(steps))
        runs += 1
        t0 = time.perf_counter()
        jax.block_until_ready(program())
        return time.perf_counter() - t0

    programs = [s.run for s in steps]
    timings = er.internal.time_interleaved(
        programs, rounds=rounds, warmup=False, run=run
    )
    if on is None:
        return timings
    if on == "fastest":
        on = min(range(len(timings)), key=lambda i: timings[i].seconds)
    return er.internal.on_one_clock(timings, on)

"""`eqx_remat.plan`: the public entry of the planner. It checks its arguments,
then solves one function (`_plan`) or a global batch's combinations of
micro-batches and loss chunking (`_batch`)."""

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, SupportsIndex

import jax

from .._inspect._memory import (
    ReplicatedArgumentsWarning,
    _v5e,
    traced_for,
    warn_replicated,
)
from .._schedules._checkpoint import Checkpoint, check_checkpoint, map_checkpoints
from .._util import split_args
from ._batch import combinations, plan_batches
from ._plan import PlanResult, _Planner, _Progress, parse_bytes


def plan(
    fn: Callable[..., Any],
    *args: Any,
    budget_bytes: SupportsIndex | str,
    target: str | None = None,
    candidates: Sequence[Checkpoint] | None = None,
    measure: bool | None = None,
    progress: bool | Literal["verbose"] = True,
    micro_batches: Sequence[SupportsIndex] | None = None,
    loss_chunks: Sequence[SupportsIndex | None] | None = None,
    in_axes: Any = (None, 0),
) -> PlanResult:
    """The checkpoint that fits a memory budget and runs a step fastest: a byte
    budget in, the checkpoint to train with out.

    ```python
    result = eqx_remat.plan(eqx.filter_grad(loss), model, batch, budget_bytes="16GiB")
    print(result)  # the pick, and the frontier of memory against step time
    model = result.apply(model)
    ```

    The pick is a uniform option (a policy, per-name decisions, `None`), a
    whole-stack schedule, or an [`eqx_remat.ranges`][] mix of two per-layer
    options over the layers of a stack. It is always compiled, and fits
    `budget_bytes` when compiled. Its step time is the clock's where the
    device is at hand (`measure`): the planner runs the programs it compiled
    and ranks them by their measured times, predicts a mix's time from its
    two options' times per layer, and runs the pick before returning it (a
    mix that runs slower than the fastest uniform option that fits is not
    returned). For a target compiled ahead of time, times are a roofline's
    estimate: FLOPs at the chip's peak, the bytes each option moves through
    device memory at its bandwidth, and offloaded bytes over the host link
    ([`eqx_remat.internal.HARDWARE`][], with sources). How it solves is told
    in the tutorial *Fit a model in a budget*.

    **Arguments:**

    - `fn`: the function to plan for: a gradient or training step, e.g.
      `eqx.filter_grad(loss)`; it must differentiate the stacks.
    - `*args`: its arguments; at least one must contain an `eqx.Module` with a
      `checkpoint` field (every zoo model has one). Array leaves may be
      `jax.ShapeDtypeStruct`s (timing runs them on arrays of that shape, dtype
      and sharding). On a target with several chips, give the batch a
      sharding (`zoo.shard_batch(batch, eqx_remat.v5e_mesh(target))`): an
      [`eqx_remat.ReplicatedArgumentsWarning`][] says when nothing is split.
    - `budget_bytes`: device memory available (per chip on a TPU target): an
      int, or a string such as `"16GiB"`, `"512MiB"` or `"1.5GB"`. Arguments,
      outputs and temporaries must add up to at most this. A budget over what
      the device holds is planned for the device, with a note.
    - `target`: `None` for the device at hand (the default backend), or
      `"v5e"` / `"v5e:AxB"` to compile for TPU v5e without a TPU (see
      [`eqx_remat.memory_report`][]).
    - `candidates`: `None` to solve; or the checkpoints to compare, each
      compiled (and timed, with `measure`).
    - `measure`: time programs by running them. `None` (the default): where
      the target is the device at hand and this is the only process (with
      several, each would time on its own clock and could choose
      differently: the roofline gives every process the same answer).
      Timing runs each program after a warm-up, round-robin with the
      others: rounds of every program (at least two) in half the time this
      call's compiles took, then, in the other half, more (at most 21 in
      all) of those not ruled out (over 3% slower than one needing no more
      memory); a program's time is the mean of
      its faster half of rounds. A program whose memory is over what the
      device has free is never run.
    - `progress`: what it does, on stderr: `True` a few lines (the stages,
      counts and times), `"verbose"` every option priced and every compile,
      `False` nothing.
    - `micro_batches`: to plan the global batch too, the micro-batch counts
      to compare (each must divide the batch; `fn` is then run as
      `eqx_remat.accumulate(fn, k, in_axes=in_axes)`, so it must be a
      gradient function, not a whole training step). Times are per global
      batch.
    - `loss_chunks`: the `loss_chunk_size`s of the model's loss head to
      compare (`None`: whole logits; the arguments must hold a module with a
      `loss_chunk_size` field, as `zoo.Transformer`).
    - `in_axes`: the batch axes of `fn`'s arguments, as
      [`eqx_remat.accumulate`][] takes them (default: `fn(model, batch)`).

    With `micro_batches` or `loss_chunks`, the first combination (fewest
    micro-batches, then the loss chunks in the order given) for which
    something fits is solved in full; each later one compiles that pick and
    up to two options that ran faster than it, where they are predicted to
    fit; the four fastest of the combinations' bests run round-robin, and
    the fastest is the pick (ahead of time, where the
    roofline cannot see what a smaller micro-batch costs a chip: the fewest
    micro-batches within 1% of its least estimate). `PlanResult.batches` lists
    them; `result.apply(model)` sets the checkpoint and the loss chunking,
    `result.step(fn)` splits the batch.

    **Returns:**

    A [`eqx_remat.PlanResult`][]: the pick, its compiled entry, the frontier
    (or the candidates' table), notes, counts and times. `print` it.

    **Raises:**

    `ValueError` for a bad budget, `measure=True` with a target that cannot
    run here, an invalid or empty list of candidates, arguments without a
    `checkpoint` field, a function that differentiates no stack (when
    solving), and when nothing fits (naming the smallest memory compiled and
    its checkpoint). A checkpoint XLA refuses to compile because it does not
    fit in one device (`RESOURCE_EXHAUSTED`) is not an error: it is recorded
    as not fitting, with XLA's figure of what it needed.
    """
    budget = parse_bytes(budget_bytes)
    if candidates is not None:
        candidates = tuple(candidates)
        if not candidates:
            raise ValueError("plan expected at least one candidate. Got none.")
        for i, c in enumerate(candidates):
            check_checkpoint(c, name=f"plan: invalid candidates[{i}]:")
    if not map_checkpoints(args, lambda c: c)[1]:
        raise ValueError(
            "plan expected arguments containing an eqx.Module with a `checkpoint` "
            "field (every zoo model has one), whose checkpoint it varies. Got none."
        )
    if progress not in (True, False, "verbose"):
        raise ValueError(
            f"plan expected progress to be True, False or 'verbose'. Got {progress!r}."
        )
    if target == jax.default_backend():
        target = None
    processes = jax.process_count()
    if measure is None:
        measure = target is None and processes == 1
    elif measure and target is not None:
        raise ValueError(
            f"plan(measure=True) times programs on the device at hand; "
            f"target={target!r} is compiled ahead of time and cannot run here. "
            "Pass measure=None (the default) or False."
        )
    elif measure and processes > 1:
        raise ValueError(
            f"plan(measure=True) times programs on one process; this is one of "
            f"{processes}, and each would time on its own clock and could choose "
            "differently. Pass measure=None (the default: the roofline, the same "
            "answer on every process) or False."
        )
    if target is not None:
        name, mesh = _v5e(target)
        warn_replicated("plan", name, mesh, split_args(args)[0])
    say = _Progress(progress)
    ways = None
    if micro_batches is not None or loss_chunks is not None:
        if candidates is not None:
            raise ValueError(
                "plan compares candidates= on one function; with micro_batches= "
                "or loss_chunks= it solves. Pass candidates=None."
            )
        ways = combinations(args, micro_batches, loss_chunks, in_axes)
    with warnings.catch_warnings(), traced_for(target):
        # Said once, above; not again for every compile.
        warnings.simplefilter("ignore", ReplicatedArgumentsWarning)
        if ways is not None:
            return plan_batches(
                fn, args, budget, target, bool(measure), say, ways, in_axes
            )
        planner = _Planner(
            fn, args, budget, target, bool(measure), say, candidates is None
        )
        if candidates is not None:
            return planner.enumerate(candidates)
        return planner.solve()

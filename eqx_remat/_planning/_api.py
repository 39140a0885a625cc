"""The planner's public entries: `eqx_remat.plan`, which checks its arguments,
then solves one function (`_loop.solve`), compares candidates (`_loop.compare`)
or solves a global batch's ways of running it (`_batch`)."""

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, SupportsIndex

import jax
import numpy as np
from jax.sharding import Mesh

from .._inspect._memory import ReplicatedArgumentsWarning, warn_replicated
from .._inspect._targets import Target
from .._schedules._checkpoint import Checkpoint, check_checkpoint, map_checkpoints
from .._util import parse_bytes, split_args
from ._batch import batch_ways, plan_batches, warn_if_chunks_do_nothing
from ._bench import Bench, Problem
from ._loop import compare, solve
from ._report import PlanResult, Progress


_EXAMPLES = {
    "candidates": "[None, 'dots', eqx_remat.every(4)]",
    "micro_batches": "(1, 2, 4)",
    "loss_chunks": "(None, 512)",
}


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
    shard: Callable[[Mesh], tuple[Callable[..., Any], tuple]] | None = None,
) -> PlanResult:
    """The checkpoint that fits a memory budget and runs a step fastest: a byte
    budget in, the checkpoint to train with out. How it solves is told once, in
    the tutorial [*Fit a model in a budget*][how-the-planner-solves]; how it
    chooses micro-batches and loss chunking, in
    [*Fit a batch, not just a model*][which-combination].

    ```python
    result = eqx_remat.plan(eqx.filter_grad(loss), model, batch, budget_bytes="16GiB")
    print(result)  # the pick, and the frontier of memory against step time
    model = result.apply(model)
    ```

    **Arguments:**

    - `fn`: the function to plan for: a gradient or training step, e.g.
      `eqx.filter_grad(loss)`; it must differentiate the stacks.
    - `*args`: its arguments; at least one must contain an `eqx.Module` with a
      `checkpoint` field (every zoo model has one). An optimiser state among
      them (a training step's) may hold copies of the model's modules, as
      optax's Adam and AdamW do in `mu` and `nu`: each copy gets what the
      model gets, and `model, opt_state = result.apply((model, opt_state))`
      switches both to the pick (see [`eqx_remat.set_checkpoint`][]). Array
      leaves may be `jax.ShapeDtypeStruct`s (timing runs them on arrays of
      that shape, dtype and sharding). On a target with several chips, give
      the batch a sharding (`zoo.shard_batch(batch, eqx_remat.v5e_mesh(target))`): an
      [`eqx_remat.ReplicatedArgumentsWarning`][] says when nothing is split.
    - `budget_bytes`: device memory available (per chip on a TPU target): an
      int `>= 0`, or a string such as `"16GiB"`, `"512MiB"` or `"1.5GB"`
      ([`eqx_remat.parse_bytes`][]). Arguments, outputs and temporaries must
      add up to at most this. A budget over what one device holds is planned
      for the device, with a note: the device at hand's limit, or what XLA
      lets a program use of a target's chip (15.75 GiB of a v5e's 16 GiB);
      less, where XLA refuses a program and says it holds less.
    - `target`: `None` (the default) or the default backend's name (e.g.
      `"cpu"`) for the device at hand; `"v5e"` / `"v5e:AxB"` (or `"v6e:AxB"`,
      `"v5p:AxBxC"`) to compile for a TPU slice without a TPU (see
      [`eqx_remat.memory_report`][]).
    - `candidates`: `None` (the default) to solve; or a non-empty sequence of
      checkpoints to compare, each compiled (and timed, with `measure`).
    - `measure`: `True` to time programs by running them, `False` to take a
      roofline's estimate ([`eqx_remat.internal.HARDWARE`][]). `None` (the
      default): `True` where the target is the device at hand and this is
      the only process (with several, each would time on its own clock and
      could choose differently: the roofline gives every process the same
      answer). A program whose memory is over what the device has free is
      never run; its time is estimated.
    - `progress`: what it says on stderr: `True` (the default) a few lines
      (the stages, counts and times), `"verbose"` every option priced and
      every compile, `False` nothing.
    - `micro_batches`: `None` (the default) to run the batch whole; or a
      non-empty sequence of micro-batch counts to compare, ints `>= 1` that
      each divide the batch. `fn` is then run as
      `eqx_remat.accumulate(fn, k, in_axes=in_axes)`, so it must be a
      gradient function, not a whole training step. Times are per global
      batch.
    - `loss_chunks`: `None` (the default) to keep the model's loss head as it
      is; or a non-empty sequence of `loss_chunk_size`s to compare, ints
      `>= 1` or `None` (whole logits). The arguments must hold a module with
      a `loss_chunk_size` field, as `zoo.Transformer`, and `fn` must call its
      `loss`: a `UserWarning` says so where `fn`'s program is the same at two
      of the sizes (it computes the logits with `__call__`).
    - `in_axes`: with `micro_batches` (only), the batch axes of `fn`'s
      arguments, as [`eqx_remat.accumulate`][] takes them (default
      `(None, 0)`: `fn(model, batch)`).
    - `shard`: `None` (the default) to plan `fn(*args)` as its arguments are
      placed; or, to choose the mesh too, a function of a mesh with axes
      `("data", "fsdp")` that returns `(fn, args)` placed on it: e.g. the
      parameters split over `"fsdp"` (`zoo.shard(model, mesh, fsdp=True,
      axis="fsdp")`), the batch over both axes (`zoo.shard_batch(batch,
      mesh, axis=("data", "fsdp"))`), the gradients kept like the
      parameters. Every split of the chips is planned (of the target's:
      [`eqx_remat.v5e_mesh`][]`(target, fsdp=k)`; on the device at hand, of
      its devices), FSDP over all of them first and data parallelism last,
      as `micro_batches` are (see [Choose the mesh][choose-the-mesh]):
      `result.mesh` is the pick's, `shard(result.mesh)` runs it. Ahead of
      time every estimate (of a checkpoint, on any mesh) adds what each chip
      sends in collectives, at the chip's interconnect rate, to the
      roofline's.

    **Returns:**

    A [`eqx_remat.PlanResult`][] (`print` it): the pick, its compiled entry,
    the frontier (with `candidates`, the candidates' table), notes, counts
    and times. Solving, the pick is a uniform option (a policy, per-name
    decisions, `None`), a whole-stack schedule, or an [`eqx_remat.ranges`][]
    mix of two per-layer options over the layers of a stack; where `fn`
    differentiates several stacks, an [`eqx_remat.PerStack`][] (one of those
    for each, by the path of its `checkpoint` field; with `micro_batches` or
    `loss_chunks` too); with `candidates`, one of them. It is always
    compiled, and fits `budget_bytes` compiled. `result.apply(model)` sets
    it (and the loss chunking, with `loss_chunks`); with `micro_batches`,
    `result.step(fn)` splits the batch; with either, `result.batches` lists
    the best of each combination tried.

    **Raises:**

    `ValueError` for a bad `budget_bytes`, `target` (another platform's name,
    a slice TPU v5e does not come in), `progress`, `measure`, `in_axes`
    without `micro_batches`, `micro_batches` (one that does not divide the
    batch too) or `loss_chunks`; an invalid or empty
    list of `candidates`, or `candidates` with `micro_batches` or
    `loss_chunks`; `measure=True` with a target compiled ahead of time or in
    a process of several; arguments without a `checkpoint` field (or, with
    `loss_chunks`, a `loss_chunk_size` field); a function that
    differentiates no stack (when solving); and when nothing fits (naming
    the smallest memory compiled and its checkpoint). A checkpoint XLA
    refuses to compile because it does not fit in one device
    (`RESOURCE_EXHAUSTED`) is not an error: it is recorded as not fitting,
    with XLA's figure of what it needed.
    """
    budget, candidates = _check(
        args, budget_bytes, candidates, micro_batches, loss_chunks, in_axes, shard
    )
    if progress not in (True, False, "verbose"):
        raise ValueError(
            f"plan expected progress to be True, False or 'verbose'. Got {progress!r}."
        )
    on = Target.of(target, "plan")
    bench = Bench(on, _measuring(measure, on.name), say=Progress(progress))
    return _run(
        bench, fn, args, budget, candidates, micro_batches, loss_chunks, in_axes, shard
    )


def plan_on(
    bench: Bench,
    fn: Callable[..., Any],
    *args: Any,
    budget_bytes: SupportsIndex | str,
    candidates: Sequence[Checkpoint] | None = None,
    micro_batches: Sequence[SupportsIndex] | None = None,
    loss_chunks: Sequence[SupportsIndex | None] | None = None,
    in_axes: Any = (None, 0),
    shard: Callable[[Mesh], tuple[Callable[..., Any], tuple]] | None = None,
) -> PlanResult:
    """[`eqx_remat.plan`][] on `bench`: its target, clock, cache and progress."""
    budget, candidates = _check(
        args, budget_bytes, candidates, micro_batches, loss_chunks, in_axes, shard
    )
    return _run(
        bench, fn, args, budget, candidates, micro_batches, loss_chunks, in_axes, shard
    )


def _run(
    bench, fn, args, budget, candidates, micro_batches, loss_chunks, in_axes, shard
):
    on, ways = bench.target, None
    if on.mesh is not None and shard is None:
        warn_replicated("plan", on.label, on.mesh, split_args(args)[0])
    if micro_batches is not None or loss_chunks is not None or shard is not None:
        meshes = [None] if shard is None else on.meshes()
        pairs = batch_ways(args, micro_batches, loss_chunks, in_axes)
        ways = [(k, c, mesh) for k, c in pairs for mesh in meshes]
    with warnings.catch_warnings(), on.placed(split_args(args)[0]).traced():
        # Said once, above; not again for every compile.
        warnings.simplefilter("ignore", ReplicatedArgumentsWarning)
        problem = Problem.of(fn, args, on)
        if ways is not None:
            if loss_chunks is not None:
                warn_if_chunks_do_nothing(fn, args, ways)
            result = plan_batches(bench, fn, args, budget, ways, in_axes, shard)
        elif candidates is not None:
            result = compare(bench, problem, budget, candidates)
        else:
            result = solve(bench, problem, budget)[0]
        stacks = tuple(dict.fromkeys(p for p, _ in bench.stacks(problem)))
    return dataclasses.replace(result, stacks=stacks)


def _check(args, budget_bytes, candidates, micro_batches, loss_chunks, in_axes, shard):
    """`(budget, candidates)`: the arguments checked and normalised."""
    if shard is not None and not callable(shard):
        raise ValueError(
            "plan expected shard to be None or a function of a mesh that returns "
            f"(fn, args) placed on it. Got {shard!r}."
        )
    budget = parse_bytes(budget_bytes)
    lists = {"candidates": candidates, "micro_batches": micro_batches}
    lists |= {"loss_chunks": loss_chunks}
    for name, value in lists.items():
        # A bare name or number is not a list of them (nor its letters).
        if value is not None and (
            isinstance(value, (str, bytes)) or not isinstance(value, Iterable)
        ):
            raise ValueError(
                f"plan expected {name} to be a sequence, e.g. {_EXAMPLES[name]}. "
                f"Got {value!r}."
            )
    if candidates is not None:
        candidates = tuple(candidates)
        if not candidates:
            raise ValueError("plan expected at least one candidate. Got none.")
        for i, c in enumerate(candidates):
            check_checkpoint(c, name=f"plan: invalid candidates[{i}]:")
        candidates = tuple(dict.fromkeys(candidates))  # each compiled once
    if micro_batches is None and in_axes != (None, 0):
        raise ValueError(
            "plan's in_axes names the batch axes to split into micro-batches, "
            f"and is used only with micro_batches. Got in_axes={in_axes!r} and "
            "no micro_batches."
        )
    if not map_checkpoints(args, lambda c: c)[1]:
        raise ValueError(
            "plan expected arguments containing an eqx.Module with a `checkpoint` "
            "field (every zoo model has one), whose checkpoint it varies. Got none."
        )
    if candidates is not None and (
        micro_batches is not None or loss_chunks is not None or shard is not None
    ):
        raise ValueError(
            "plan compares candidates= on one function; with micro_batches=, "
            "loss_chunks= or shard= it solves. Pass candidates=None."
        )
    return budget, candidates


def _measuring(measure: Any, target: str | None) -> bool:
    """Whether `plan` times programs: `measure` checked against `target`
    (`None`: the device at hand) and the number of processes."""
    if measure is not None and not isinstance(measure, (bool, np.bool_)):
        raise ValueError(
            f"plan expected measure to be True, False or None. Got {measure!r}."
        )
    processes = jax.process_count()
    if measure is None:
        return target is None and processes == 1
    if measure and target is not None:
        raise ValueError(
            f"plan(measure=True) times programs on the device at hand; "
            f"target={target!r} is compiled ahead of time and cannot run here. "
            "Pass measure=None (the default) or False."
        )
    if measure and processes > 1:
        raise ValueError(
            f"plan(measure=True) times programs on one process; this is one of "
            f"{processes}, and each would time on its own clock and could choose "
            "differently. Pass measure=None (the default: the roofline, the same "
            "answer on every process) or False."
        )
    return bool(measure)

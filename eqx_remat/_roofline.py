"""The roofline's price of a function, by tracing (no compile): its stacks
(`stacks_of`), what it keeps, computes and moves under a checkpoint (`price`),
and one step's roofline time (`roofline_seconds`), the planner's cost where
it cannot time."""

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from ._combinators import stacking_lists
from ._inspect._flops import count_flops
from ._inspect._hardware import Hardware, bytes_moved, roofline_time
from ._inspect._jaxpr import checkpoint_names, saved_across
from ._inspect._memory import ReplicatedArgumentsWarning
from ._inspect._targets import Target, share_per_chip
from ._schedules._checkpoint import (
    Planned,
    checkpoint_paths,
    copies,
    map_checkpoints,
    part_paths,
    set_checkpoint,
)
from ._schedules._engine import Layers, Schedule
from ._schedules._ranges import ranges
from ._util import split_args, traceable


@dataclasses.dataclass(frozen=True)
class _Probe(Schedule):
    """A schedule that records the depth of every stack it checkpoints (its
    forward pass runs when a differentiated function is traced) and then
    differentiates the stack as one segment. Compared by identity of `seen`."""

    seen: list = dataclasses.field(compare=False, hash=False)
    policy: Any = None
    path: str = ""

    def forward(self, layers: Layers, carry: Any) -> tuple[Any, Any]:
        self.seen.append((self.path, layers.depth))
        return layers.run(carry, 0, layers.depth), carry

    def backward(self, layers: Layers, saved: Any, cts: Any) -> Any:
        return layers.reverse_segment(0, layers.depth, saved, cts)

    def evaluations(self, depth: int) -> int:
        return 2 * depth


def stacks_of(fn: Callable[..., Any], args: tuple) -> list[tuple[str, int]]:
    """`(path, depth)` of every run of a stack whose `checkpoint` field is in
    `args` and that `fn` differentiates, in the order `fn` runs them (`path`:
    the field's, as [`eqx_remat.set_checkpoint`][] takes it, from inside the
    argument that holds the stacks where one does: `part_paths`): `fn` is
    traced once (`jax.eval_shape`), each `checkpoint` field set to a probe,
    the copies of the model's fields in an optimiser state to their
    field's."""
    seen: list[tuple[str, int]] = []
    # A copy of the model (in Adam's state) gets its field's probe, and so
    # the same static metadata as the model.
    copied = copies(args)
    probes = {
        p: _Probe(seen, path=p) for p in checkpoint_paths(args) if p not in copied
    }
    f, dynamic = traceable(fn, set_checkpoint(args, probes))
    with stacking_lists():
        jax.eval_shape(f, dynamic)
    spelling = part_paths(args, [p for p, _ in seen])
    return [(spelling[p], depth) for p, depth in seen]


class Price(NamedTuple):
    """What tracing a function under one checkpoint told (the whole program's,
    all chips together): the bytes it keeps across its stacks on the device
    and on the host, its FLOPs (loop trip counts and recomputation included),
    the bytes it moves through device memory (`bytes_moved`) and the
    `checkpoint_name` tags in its program."""

    device: int
    host: int
    flops: int
    moved: int
    tags: tuple[str, ...] = ()

    def seconds(self, hw: Hardware, share: float = 1.0) -> float:
        """The roofline's seconds on one chip of `hw` holding `share` of it."""
        s = share
        return roofline_time(hw, s * self.flops, s * self.moved, s * self.host)


def price(
    fn: Callable[..., Any], args: tuple, checkpoint: Planned, depths: frozenset[int]
) -> Price:
    """`fn(*args)`'s `Price` under `checkpoint`: traced, not compiled."""
    checkpointed = set_checkpoint(args, checkpoint)
    f, dynamic = traceable(fn, checkpointed)
    with stacking_lists():  # a list of layers as a stack: see `stacking_lists`
        jaxpr = jax.make_jaxpr(f)(dynamic).jaxpr
        flops = count_flops(fn, *checkpointed)
    device, host = saved_across(jaxpr, depths)
    # A schedule's segments save their layers' residuals (as its inner policy
    # says) in loops shorter than the stack: counted too, once per trip.
    written = saved_across(jaxpr, None, per_trip=True)[0]
    moved = bytes_moved(flops, written)
    return Price(device, host, int(flops), moved, tuple(checkpoint_names(jaxpr)))


def check_stacks(runs: Sequence[tuple[str, int]]) -> None:
    """A `ValueError` where the function runs no stack (`runs`, as `stacks_of`)."""
    if not runs:
        raise ValueError(
            "plan expected fn to differentiate the stacks of the modules in "
            "its arguments (pass a gradient or training step, e.g. "
            "eqx.filter_grad(loss)). Got a function whose backward pass runs "
            "no checkpointed stack."
        )


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
    c = found[0]
    parts = c.parts if isinstance(c, ranges) else ((1, c),)
    with warnings.catch_warnings(), on.placed(split_args(args)[0]).traced():
        warnings.simplefilter("ignore", ReplicatedArgumentsWarning)
        runs = stacks_of(fn, args)
        check_stacks(runs)
        depths = frozenset(d for _, d in runs)
        prices = [price(fn, args, p, depths) for _, p in parts]
    hw, s = on.hardware()[0], share_per_chip(args, on.chips)
    seconds = (n * p.seconds(hw, s) for (n, _), p in zip(parts, prices))
    return sum(seconds) / sum(n for n, _ in parts)

"""The solver's pieces: what tracing tells of a function (its stacks, and the
`Price` of a checkpoint: the bytes it keeps and moves, its FLOPs and tags), the
roofline, and a stack's best two-option mix at a budget. Memory and cost of a
mix are a base plus a per-layer term per range, so the optimum mixes two
neighbours on the lower convex hull of `(bytes, time)` (why, and how whole
layers are chosen: the tutorial *Fit a model in a budget*, step 3)."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np

from .._combinators import stacking_lists
from .._inspect._flops import count_flops
from .._inspect._hardware import bytes_moved
from .._inspect._jaxpr import checkpoint_names, saved_across
from .._schedules._checkpoint import (
    Checkpoint,
    Planned,
    checkpoint_paths,
    copies,
    part_paths,
    set_checkpoint,
)
from .._schedules._engine import Layers, Schedule
from .._util import traceable


# --- the stacks ---------------------------------------------------------------


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


# --- the options ----------------------------------------------------------------


class Option(NamedTuple):
    """A checkpoint priced per layer and per chip: the bytes it keeps across the
    stack on the device and on the host, the FLOPs it adds to `None`'s, the
    step time of the whole function under it (a mix of `n` layers of `a` and
    `D - n` of `b` takes `n * a.time + (D - n) * b.time`), and the whole
    function's FLOPs under it."""

    checkpoint: Checkpoint
    bytes: float
    host_bytes: float
    flops: float
    time: float
    total_flops: int


Real = float | int
T = TypeVar("T")


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


# --- the hull and the mix -------------------------------------------------------


def lower_hull(options: Sequence[Option]) -> list[Option]:
    """The options on the lower convex hull of `(bytes, time)` from the
    lightest (fewest bytes, then least time) to the cheapest (least time, then
    fewest bytes): each one cheaper and heavier than the one before."""
    pts = sorted(options, key=lambda o: (o.bytes, o.time))
    hull: list[Option] = []
    for p in pts:
        if hull and p.time >= hull[-1].time:
            continue  # heavier and no cheaper: dominated
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
            hull.pop()
        hull.append(p)
    return hull


def _cross(a: Option, b: Option, c: Option) -> float:
    """> 0 when `b` lies strictly below the segment from `a` to `c`."""
    return (b.bytes - a.bytes) * (c.time - a.time) - (b.time - a.time) * (
        c.bytes - a.bytes
    )


Predict = Callable[[Option, Option, np.ndarray], np.ndarray]
"""`predict(light, heavy, n)`: predicted memory of `depth - n` layers of
`light` then `n` of `heavy`, for an array of counts `n` (`light` on every
layer where `n` is 0)."""


def linear(base: Callable[[Option], float], depth: int) -> Predict:
    """The model before any mix compiled: a base per option plus what each
    layer keeps, in the larger of the backward pass's two phases: the heavy
    layers reversed first, everything saved held, with the heavy option's
    working memory (its base); then the light ones, the heavy layers' saved
    values freed, with the light option's (larger: it recomputes more)."""

    def predict(light: Option, heavy: Option, n: np.ndarray) -> np.ndarray:
        rest = (depth - n) * light.bytes
        return np.asarray(
            np.maximum(base(heavy) + n * heavy.bytes + rest, base(light) + rest)
        )

    return predict


def pareto(
    items: Sequence[T],
    key: Callable[[Any], tuple[Real, Real]] = lambda o: (o.bytes, o.time),
) -> list[T]:
    """The items no other beats in both memory and time (`key(item)`: by
    default an option's bytes and time), least memory first (of equal ones,
    the first)."""
    out: list[T] = []
    for x in sorted(items, key=key):
        if not out or key(x)[1] < key(out[-1])[1]:
            out.append(x)
    return out


class Mix(NamedTuple):
    """`n` layers of `heavy` and `depth - n` of `light` (`n == 0`: `light` on
    every layer), its predicted memory and its cost."""

    light: Option
    heavy: Option
    n: int
    predicted: float
    cost: float


def best_mix(
    options: Sequence[Option],
    predict: Predict,
    depth: int,
    budget: Real,
    limit: Callable[[Option, Option], int] | None = None,
) -> Mix | None:
    """The cheapest mix of at most two options (`depth - n` layers of `light`,
    then `n` of `heavy`) predicted (`predict(light, heavy, n)`) to fit
    `budget`; `None` when no option fits on every layer. With whole layers,
    rounding can make a pair other than hull neighbours better, so every pair
    of Pareto options is tried at every count (no compile): the heavier is
    the cheaper, so the most heavy layers that fit are a pair's best;
    `limit(light, heavy)` bounds `n`. Every option is tried on every layer,
    Pareto or not (`predict` knows a compiled option's memory). A mix never
    has one layer of `None`: that is not a loop, and XLA schedules it with
    its neighbours, not as its per-layer price says."""
    front = pareto(options)
    counts = np.arange(1, depth)
    best: Mix | None = None
    for light in options:
        uniform = float(predict(light, light, np.zeros(1))[0])
        if uniform > budget:
            continue
        mixes = [Mix(light, light, 0, uniform, 0.0)]
        heavier = front[front.index(light) + 1 :] if light in front else []
        for heavy in heavier:  # heavier and cheaper
            memory = predict(light, heavy, counts)
            ok = memory <= budget
            if limit is not None:
                ok &= counts <= limit(light, heavy)
            if heavy.checkpoint is None:
                ok &= counts != 1  # not a loop: see above
            if ok.any():
                k = int(np.flatnonzero(ok)[-1])
                mixes.append(Mix(light, heavy, int(counts[k]), float(memory[k]), 0.0))
        for m in mixes:
            m = m._replace(cost=m.n * m.heavy.time + (depth - m.n) * m.light.time)
            if best is None or (m.cost, m.predicted) < (best.cost, best.predicted):
                best = m
    return best

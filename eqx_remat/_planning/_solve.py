"""The solver's pieces: a checkpoint priced per layer (`Option`), the lower
convex hull and Pareto front of options, and a stack's best two-option mix at
a budget. Memory and cost of a mix are a base plus a per-layer term per range,
so the optimum mixes two neighbours on the lower convex hull of `(bytes,
time)` (why, and how whole layers are chosen: the tutorial *Fit a model in a
budget*, step 3)."""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np

from .._schedules._checkpoint import Checkpoint


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

"""The planner's one pricer (`price_function`): a function's stacks, and each
stack's per-layer options priced per layer and per chip by tracing (`Prices`,
frozen; one stack the case k = 1). Compiled only to ask whether an offloading
option on a stack's hull pays; the bench caches it."""

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .._inspect._flops import count_flops
from .._inspect._hardware import Hardware
from .._policies._values import offload_names, save_names
from .._roofline import Price, check_stacks, price
from .._schedules._binomial import binomial
from .._schedules._checkpoint import (
    Checkpoint,
    PerStack,
    Planned,
    checkpoint_name,
    set_checkpoint,
)
from .._schedules._engine import Schedule
from .._schedules._uniform import every, nested, recursive
from .._util import format_flops, format_size
from ._solve import Option, lower_hull


DEFAULT_CANDIDATES: tuple[Checkpoint, ...] = (
    None,
    "dots",
    "dots_no_batch",
    "nothing",
    every(2),
    every(4),
    every(8),
    every(16),
    nested(2),
    nested(3),
    recursive(),
    binomial(2),
    binomial(4),
    binomial(8),
    binomial(16),
    binomial(32),
)
"""No checkpointing, the policies that save less than everything, and each
schedule over a grid of parameters. When [`eqx_remat.plan`][] solves, its
schedules are the whole-stack options it compares with its pick (those that
make sense at the stack's depth: `every(k)` and `binomial(s)` below it); pass
`candidates=eqx_remat.DEFAULT_CANDIDATES` to compile and compare all of them
instead."""


class Stack(NamedTuple):
    """One stack's `path`, `depth` (the layers a mix ranges over: 1 where its
    runs differ in depth) and options, each priced with this stack on it and
    every other on `"nothing"`, per layer and per chip."""

    path: str
    depth: int
    options: tuple[Option, ...]

    def option(self, c: Planned) -> Option | None:
        return next((o for o in self.options if o.checkpoint == c), None)


@dataclasses.dataclass(frozen=True)
class Prices:
    """What tracing the function told: its `stacks` (each a `Stack`, in the
    order it first runs), the `depths` of every run of a stack, the model's
    `tags`, the `base` a plan's price adds to its stacks' options' (an
    option is priced with every other stack on `"nothing"`, so `k` stacks
    count that `k - 1` times too many: `base` is minus that), the
    whole-stack `schedules` worth comparing (one stack) with their FLOPs,
    and the `notes` to say (offloading options that do not pay)."""

    stacks: tuple[Stack, ...]
    depths: tuple[int, ...]
    tags: tuple[str, ...]
    base: Option
    schedules: tuple[tuple[Schedule, int], ...]
    notes: tuple[str, ...] = ()

    @property
    def per(self) -> int:
        """The depth of one stack (1 for several, or runs of several depths)."""
        return self.stacks[0].depth if len(self.stacks) == 1 else 1

    @property
    def options(self) -> tuple[Option, ...]:
        """The options of one stack (none where there are several)."""
        return self.stacks[0].options if len(self.stacks) == 1 else ()

    def option(self, c: Planned) -> Option | None:
        return self.stacks[0].option(c) if len(self.stacks) == 1 else None


def useful(c: Schedule, depth: int) -> bool:
    """Whether schedule `c` differs from a cheaper one at this depth."""
    if isinstance(c, every):
        return c.k < depth
    if isinstance(c, binomial):
        return c.slots < depth
    if isinstance(c, nested):
        return 2**c.levels <= depth
    return depth > 2


def price_function(
    fn: Callable[..., Any],
    args: tuple,
    runs: Sequence[tuple[str, int]],
    hw: Hardware,
    share: float,
    say: Callable[..., None],
    check: Callable[[Planned], str | None] | None = None,
) -> Prices:
    """Trace `fn(*args)`: each of its stacks (`runs`: each run's `(path,
    depth)`, as `stacks_of`) on each of its per-layer options, every other
    stack on `"nothing"` (each said, as a detail). With `check` (why `c` does
    not pay, or `None`), an offloading option on a stack's lower hull that
    does not pay is dropped, with a note."""
    say("tracing the function to find its stacks")
    check_stacks(runs)
    stacks, depths = list(dict(runs).items()), tuple(d for _, d in runs)
    kinds, several = frozenset(depths), len(stacks) > 1
    per = depths[0] if len(set(depths)) == 1 else 1
    nothing = {p: "nothing" for p, _ in stacks}
    raw: dict[Planned, Price] = {}
    tags: list[str] = []

    def on(path: str, c: Checkpoint) -> Planned:
        return PerStack({**nothing, path: c}) if several else c

    def priced(c: Planned) -> Price:
        if c not in raw:
            start = time.perf_counter()
            raw[c] = p = price(fn, args, c, kinds)
            d = per if not several else 1
            say(
                f"priced {checkpoint_name(c)}: {format_size(share * p.device / d)}"
                + ("/layer" if not several else "")
                + (
                    f" + {format_size(share * p.host / d)} on the host"
                    if p.host
                    else ""
                )
                + f", {format_flops(p.flops)} FLOPs, {format_size(p.moved)} moved "
                f"({time.perf_counter() - start:.1f} s)",
                detail=True,
            )
            tags.extend(t for t in p.tags if t not in tags)
        return raw[c]

    # Without checkpointing first: its tags, in the order the program has them.
    priced(PerStack({p: None for p in nothing}) if several else None)
    out, notes = [], []
    for path, depth in stacks:
        each = functools.partial(lambda path, c: priced(on(path, c)), path)
        stack = _stack(path, depth if several else per, tags, each, share, hw)
        if check is not None:
            checked = functools.partial(lambda path, c: check(on(path, c)), path)
            options, dropped = _drop_unpaid(stack.options, checked, say)
            stack, notes = stack._replace(options=options), notes + dropped
        out.append(stack)
        if several:
            n = len(stack.options)
            say(f"priced {n} options of {path} ({depth} layers)", detail=True)
    # A plan counts every stack on "nothing" once per stack but one too many.
    base = Option("nothing", 0.0, 0.0, 0.0, 0.0, 0)
    if several:
        o = _option("nothing", priced(PerStack(nothing)), 0, 1, share, hw)
        k = 1 - len(stacks)
        base = o._replace(**{f: k * getattr(o, f) for f in Option._fields[1:]})
    schedules = () if several else tuple(_schedules(fn, args, min(depths)))
    return Prices(tuple(out), depths, tuple(tags), base, schedules, tuple(notes))


def _stack(
    path: str,
    depth: int,
    tags: list[str],
    priced: Callable[[Checkpoint], Price],
    share: float,
    hw: Hardware,
) -> Stack:
    """One stack's options, from `priced(c)` (a `ValueError` for a tag it does
    not have): the uniform policies (with a host link, the offloading one),
    one `save_names` per tag, then of the tags ordered by the recomputation
    they save per byte, each prefix (of two and more) saved, and offloaded."""
    host = hw.host_bytes_per_s is not None
    by: dict[Checkpoint, Price] = {}
    uniform = [None, "dots", "dots_no_batch", "nothing"]
    uniform += ["offload_dots_no_batch"] if host else []
    for c in [*uniform, *(save_names(t) for t in tags)]:
        try:
            by[c] = priced(c)
        except ValueError as e:  # a tag of another stack: not an option here
            if "tags nothing" not in str(e):
                raise
    nothing = by["nothing"]
    singles = [
        (t, by[c].device - nothing.device, nothing.flops - by[c].flops)
        for t in tags
        if (c := save_names(t)) in by
    ]
    order = sorted(singles, key=lambda s: -(s[2] / s[1]) if s[1] > 0 else -math.inf)
    names = [t for t, _, _ in order] if len(singles) > 1 else []
    prefixes = [save_names(*names[:k]) for k in range(2, len(names) + 1)]
    if host:
        prefixes += [offload_names(*names[:k]) for k in range(1, len(names) + 1)]
    for c in prefixes:
        by[c] = priced(c)
    options = (_option(c, by[c], by[None].flops, depth, share, hw) for c in by)
    return Stack(path, depth, tuple(options))


def _drop_unpaid(
    options: tuple[Option, ...],
    check: Callable[[Checkpoint], str | None],
    say: Callable[..., None],
) -> tuple[tuple[Option, ...], list[str]]:
    """`options` less each offloading option on their lower hull that does
    not pay (`check`, once each: only hull options can be picked), until
    every one left on the hull pays; and the notes that say so."""
    checked: set[Checkpoint] = set()
    notes: list[str] = []
    while True:
        unchecked = [
            o.checkpoint
            for o in lower_hull(options)
            if o.host_bytes > 0 and o.checkpoint not in checked
        ]
        if not unchecked:
            return options, notes
        for c in unchecked:
            checked.add(c)
            say(f"checking that offloading pays: {checkpoint_name(c)}", detail=True)
            why = check(c)
            if why is not None:
                options = tuple(o for o in options if o.checkpoint != c)
                notes.append(
                    f"{checkpoint_name(c)} offloads, but compiled it does not pay "
                    f"({why}): not an option"
                )


def _option(
    c: Checkpoint, p: Price, flops_none: int, per: int, s: float, hw: Hardware
) -> Option:
    return Option(
        c,
        s * p.device / per,
        s * p.host / per,
        (p.flops - flops_none) / per,
        p.seconds(hw, s) / per,
        p.flops,
    )


def _schedules(fn: Callable, args: tuple, depth: int) -> Sequence[tuple[Schedule, int]]:
    return [
        (c, int(count_flops(fn, *set_checkpoint(args, c))))
        for c in DEFAULT_CANDIDATES
        if isinstance(c, Schedule) and useful(c, depth)
    ]

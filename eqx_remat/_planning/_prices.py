"""What tracing a function tells the planner, priced once: its stacks, and each
per-layer option per layer and per chip (`Prices`, frozen). Traced, never run;
compiled only to ask whether an offloading option on the hull pays (`check`);
the bench caches it per function, arguments and target."""

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._inspect._flops import count_flops
from .._inspect._hardware import Hardware
from .._policies._values import save_names
from .._schedules._binomial import binomial
from .._schedules._checkpoint import (
    Checkpoint,
    Planned,
    checkpoint_name,
    set_checkpoint,
)
from .._schedules._engine import Schedule
from .._schedules._uniform import every, nested, recursive
from .._util import format_flops
from ._evidence import Price
from ._report import format_size
from ._solve import (
    Option,
    lower_hull,
    per_layer_options,
    prefix_options,
    price,
    roofline_time,
    stack_depths,
)


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


@dataclasses.dataclass(frozen=True)
class Prices:
    """What tracing the function told: its stacks, and each per-layer option
    priced per layer and per chip.

    - `depths`: the depth of each differentiated stack, in the order it runs.
    - `per`: the depth all stacks share (mixes are of that many layers), or 1
      where stacks of different depths cannot be mixed.
    - `share`: the part of the activations one chip holds.
    - `options`: the per-layer options ([`Option`][]s, time by the roofline).
    - `tags`: the model's `checkpoint_name` tags.
    - `flops_none`: the function's FLOPs without checkpointing.
    - `schedules`: the whole-stack schedules worth comparing, with their FLOPs.
    - `notes`: what the pricing found that the result should say (offloading
      options dropped because they do not pay).
    """

    depths: tuple[int, ...]
    per: int
    share: float
    options: tuple[Option, ...]
    tags: tuple[str, ...]
    flops_none: int
    schedules: tuple[tuple[Schedule, int], ...]
    notes: tuple[str, ...] = ()

    def option(self, c: Planned) -> Option | None:
        for o in self.options:
            if o.checkpoint == c:
                return o
        return None


def useful(c: Schedule, depth: int) -> bool:
    """Whether schedule `c` differs from a cheaper one at this depth."""
    if isinstance(c, every):
        return c.k < depth
    if isinstance(c, binomial):
        return c.slots < depth
    if isinstance(c, nested):
        return 2**c.levels <= depth
    return depth > 2


def trace_price(fn: Callable, args: tuple, c: Planned, depths: frozenset) -> Price:
    """`c`'s [`Price`][]: `fn(*args)` traced with every checkpoint field `c`."""
    device, host, flops, moved, _ = price(fn, args, c, depths)
    return Price(device, host, flops, moved)


def price_function(
    fn: Callable[..., Any],
    args: tuple,
    hw: Hardware,
    share: float,
    say: Callable[..., None],
    check: Callable[[Checkpoint], str | None] | None = None,
) -> Prices:
    """Trace `fn(*args)`: its stacks, then each per-layer option (`say` tells
    each, as a detail). With `check`, an offloading option on the lower hull
    is checked once (`check(c)`: why it does not pay, compiled beside its
    save-on-device twin, or `None`) and dropped, with a note, where it does
    not pay; then the hull is taken again."""
    say("tracing the function to find its stacks")
    depths = tuple(stack_depths(fn, args))
    if not depths:
        raise ValueError(
            "plan expected fn to differentiate the stacks of the modules in "
            "its arguments (pass a gradient or training step, e.g. "
            "eqx.filter_grad(loss)). Got a function whose backward pass runs "
            "no checkpointed stack."
        )
    per = depths[0] if len(set(depths)) == 1 else 1
    kinds = frozenset(depths)
    raw: dict[Checkpoint, tuple[int, int, int, int]] = {}
    tags: list[str] = []

    def priced(c: Checkpoint) -> None:
        start = time.perf_counter()
        device, host, flops, moved, names = price(fn, args, c, kinds)
        raw[c] = device, host, flops, moved
        say(
            f"priced {checkpoint_name(c)}: {format_size(share * device / per)}/layer"
            + (f" + {format_size(share * host / per)} on the host" if host else "")
            + f", {format_flops(flops)} FLOPs, {format_size(moved)} moved "
            f"({time.perf_counter() - start:.1f} s)",
            detail=True,
        )
        tags.extend(t for t in names if t not in tags)

    priced(None)
    host_link = hw.host_bytes_per_s is not None
    for c in per_layer_options(tags, host_link)[1:]:
        priced(c)
    nothing = raw["nothing"]
    singles = [
        (t, raw[save_names(t)][0] - nothing[0], nothing[2] - raw[save_names(t)][2])
        for t in tags
    ]
    for c in prefix_options(singles, host_link) if len(tags) > 1 else []:
        priced(c)
    options = {c: _option(c, raw[c], raw[None][2], per, share, hw) for c in raw}
    notes = [] if check is None else _drop_unpaid(options, check, say)
    return Prices(
        depths,
        per,
        share,
        tuple(options.values()),
        tuple(tags),
        raw[None][2],
        tuple(_schedules(fn, args, min(depths))),
        tuple(notes),
    )


def _drop_unpaid(
    options: dict[Checkpoint, Option],
    check: Callable[[Checkpoint], str | None],
    say: Callable[..., None],
) -> list[str]:
    """Drop from `options` each offloading option on their lower hull that
    does not pay (`check`), until every one left on the hull pays; the notes
    that say so. Only hull options can be picked or mixed, so only they are
    compiled (each once, beside its twin)."""
    checked: set[Checkpoint] = set()
    notes: list[str] = []
    while True:
        unchecked = [
            o.checkpoint
            for o in lower_hull(list(options.values()))
            if o.host_bytes > 0 and o.checkpoint not in checked
        ]
        if not unchecked:
            return notes
        for c in unchecked:
            checked.add(c)
            say(f"checking that offloading pays: {checkpoint_name(c)}", detail=True)
            why = check(c)
            if why is not None:
                del options[c]
                notes.append(
                    f"{checkpoint_name(c)} offloads, but compiled it does not pay "
                    f"({why}): not an option"
                )


def _option(
    c: Checkpoint,
    raw: tuple[int, int, int, int],
    flops_none: int,
    per: int,
    s: float,
    hw: Hardware,
) -> Option:
    device, host, flops, moved = raw
    return Option(
        c,
        s * device / per,
        s * host / per,
        (flops - flops_none) / per,
        roofline_time(hw, s * flops, s * moved, s * host) / per,
        flops,
    )


def _schedules(fn: Callable, args: tuple, depth: int) -> Sequence[tuple[Schedule, int]]:
    return [
        (c, int(count_flops(fn, *set_checkpoint(args, c))))
        for c in DEFAULT_CANDIDATES
        if isinstance(c, Schedule) and useful(c, depth)
    ]

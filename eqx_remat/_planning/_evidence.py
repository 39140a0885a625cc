"""What compiles and clocks have said about one function, as one frozen value
(`Evidence`): each answer of the bench folds into a new one, nothing is
reassigned; the budget in force, whether a record fits, the counts and the
seconds are derived from it."""

import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from .._inspect._clock import Timing
from .._inspect._compiled import Compiled
from .._roofline import Price
from .._schedules._checkpoint import PerStack, Planned
from .._schedules._ranges import ranges


class Raced(NamedTuple):
    """Programs run round-robin on one clock: the pick, then its rivals;
    `timings` in that order (`None`: no time to run them, and no earlier race)."""

    run: tuple[Planned, ...]
    timings: tuple[Timing, ...] | None


def is_mix(c: Planned) -> bool:
    """Whether `c` mixes two options over the layers of a stack (of any)."""
    if isinstance(c, PerStack):
        return any(isinstance(k, ranges) for k in c.values())
    return isinstance(c, ranges)


def _frozen(mapping: Mapping) -> Mapping:
    return types.MappingProxyType(dict(mapping))


def _empty() -> Mapping:
    return _frozen({})


@dataclasses.dataclass(frozen=True, eq=False)
class Evidence:
    """What compiles and clocks have said, for one function and arguments;
    every method that adds returns a new value.

    - `asked`: the budget asked for; `capacity`: what one device holds (`None`:
      the host's).
    - `records`: each program this call compiled or took from the cache, in
      order (a refusal has `report=None` and XLA's message); `predicted`: the
      memory the model predicted for each; `fresh`: those this call compiled,
      with the seconds it took.
    - `timings`: measured step times; `timed_s`: seconds spent timing.
    - `earlier_mixes`: earlier calls' compiled mixes' memory; `raced_mixes`:
      the mixes they raced, in the order they compiled them.
    - `priced`: checkpoints priced by tracing, besides the options.
    - `races`: the races run; `runnable`: the records that can run here;
      `offered`: what the clock was asked to time."""

    asked: int
    capacity: int | None = None
    records: Mapping[Planned, Compiled] = dataclasses.field(default_factory=_empty)
    predicted: Mapping[Planned, float | None] = dataclasses.field(
        default_factory=_empty
    )
    fresh: Mapping[Planned, float] = dataclasses.field(default_factory=_empty)
    timings: Mapping[Planned, Timing] = dataclasses.field(default_factory=_empty)
    timed_s: float = 0.0
    earlier_mixes: Mapping[Planned, int] = dataclasses.field(default_factory=_empty)
    raced_mixes: tuple[Planned, ...] = ()
    priced: Mapping[Planned, Price] = dataclasses.field(default_factory=_empty)
    races: tuple[Raced, ...] = ()
    runnable: frozenset = frozenset()
    offered: frozenset = frozenset()

    # --- adding ----------------------------------------------------------------

    def compiled(
        self,
        record: Compiled,
        fresh_s: float | None,
        predicted: float | int | None,
        runnable: bool = False,
    ) -> "Evidence":
        """With `record` (compiled by this call in `fresh_s` seconds, or taken
        from the cache: `None`), the memory predicted for it, and whether it
        can run here."""
        c = record.checkpoint
        if c in self.records:
            return self
        fresh = self.fresh if fresh_s is None else {**self.fresh, c: fresh_s}
        return dataclasses.replace(
            self,
            records=_frozen({**self.records, c: record}),
            predicted=_frozen(
                {**self.predicted, c: None if predicted is None else float(predicted)}
            ),
            fresh=_frozen(fresh),
            runnable=self.runnable | ({c} if runnable else set()),
        )

    def timed(
        self,
        timings: Mapping[Planned, Timing],
        seconds: float,
        offered: Sequence[Planned] = (),
    ) -> "Evidence":
        """With step times `timings` (replacing earlier ones), `seconds` more
        spent running programs, and what the clock was `offered`."""
        return dataclasses.replace(
            self,
            timings=_frozen({**self.timings, **timings}),
            timed_s=self.timed_s + seconds,
            offered=self.offered | set(offered) | set(timings),
        )

    def raced(self, race: Raced, seconds: float) -> "Evidence":
        """With `race`: each program's time is the race's, which decides
        between them (one clock, the same rounds), however few its rounds."""
        out = self.timed(dict(zip(race.run, race.timings or ())), seconds)
        return dataclasses.replace(out, races=(*self.races, race))

    def with_price(self, c: Planned, price: Price) -> "Evidence":
        return dataclasses.replace(self, priced=_frozen({**self.priced, c: price}))

    # --- what follows ------------------------------------------------------------

    @property
    def xla_capacity(self) -> int | None:
        """The least of what XLA's refusals say one device holds, if any said."""
        said = (r.available_bytes for r in self.records.values())
        return min((x for x in said if x is not None), default=None)

    @property
    def budget(self) -> int:
        """The budget in force: the asked one, at most what one device holds
        and what XLA said one device holds."""
        limits = [self.asked, self.capacity, self.xla_capacity]
        return min(x for x in limits if x is not None)

    def fits(self, record: Compiled) -> bool:
        return record.report is not None and record.report.total_bytes <= self.budget

    @property
    def mixes(self) -> Mapping[Planned, int]:
        """Compiled mixes' memory: earlier calls' and this call's."""
        mine = {
            c: r.report.total_bytes
            for c, r in self.records.items()
            if is_mix(c) and r.report is not None
        }
        return _frozen({**self.earlier_mixes, **mine})

    def failed_mixes(self) -> list[Planned]:
        """The mixes this call compiled that do not fit, in order."""
        return [c for c, r in self.records.items() if is_mix(c) and not self.fits(r)]

    @property
    def compiles(self) -> int:
        """How many programs this call compiled (not taken from the cache)."""
        return len(self.fresh)

    @property
    def compile_s(self) -> float:
        return float(sum(self.fresh.values()))

    @property
    def left_s(self) -> float:
        """What is left of the time timing may take: this call's fresh
        compiles' time, less what timing took so far."""
        return self.compile_s - self.timed_s

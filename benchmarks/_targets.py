"""The project's performance targets, defined once as data: what is measured,
the threshold, and on which presets. `run.py` evaluates them on a run's rows and
stores the verdicts in its JSON; `report.py` only formats what the JSON says.

A verdict is `met: true/false`, or `null` where this run could not measure the
figure (no timings when compiling for a TPU ahead of time).
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _models


Rows = Sequence[dict[str, Any]]
_PHRASE = {"temp_bytes": "temp memory", "flops": "FLOPs", "step_s": "step time"}


def _selects(on: Any, name: str, preset: _models.Preset) -> bool:
    return isinstance(preset, on) if isinstance(on, type) else name in on


def _ours(rows: Rows, group: str) -> dict[str, dict[str, Any]]:
    return {
        r["checkpoint"]: r
        for r in rows
        if r["group"] == group and r["impl"] == "eqx_remat"
    }


def _verdict(
    name: str,
    group: str,
    metric: str,
    limit: float,
    value: float | None,
    measured: str,
    why: str = "",
    at_least: bool = False,
) -> dict[str, Any]:
    met = (
        None if value is None else bool(value >= limit if at_least else value <= limit)
    )
    return {
        "name": f"{group}: {name}",
        "target": name,
        "preset": group,
        "metric": metric,
        "threshold": limit,
        "value": value,
        "met": met,
        "measured": measured if value is not None else "not measured here",
        "why": why,
    }


def _ratio(a: dict | None, b: dict | None, metric: str) -> float | None:
    if not a or not b or a.get(metric) is None or not b.get(metric):
        return None
    return a[metric] / b[metric]


@dataclasses.dataclass(frozen=True)
class VsNone:
    """Our `checkpoint`'s `metric` is at most `at_most` x `None`'s."""

    on: Any  # a Preset type, or preset names
    checkpoint: str
    metric: str
    at_most: float

    def evaluate(self, rows: Rows, group: str) -> list[dict[str, Any]]:
        ours = _ours(rows, group)
        if self.checkpoint not in ours or "None" not in ours:
            return []  # not in this run
        x = _ratio(ours.get(self.checkpoint), ours.get("None"), self.metric)
        name = f"{self.checkpoint!r} {_PHRASE[self.metric]} <= {self.at_most:.2f}x None"
        return [
            _verdict(
                name,
                group,
                self.metric,
                self.at_most,
                x,
                "" if x is None else f"{x:.3f}x",
            )
        ]


@dataclasses.dataclass(frozen=True)
class VsPeer:
    """Ours / a peer's `metric`, for every pair with peers of `impl` (only our
    schedules of kind `schedule`, if given), at most `at_most`. `cpu_note` is
    said beside the verdict when the group's rows were measured on a CPU."""

    on: Any
    impl: str
    metric: str
    at_most: float
    schedule: str | None = None
    cpu_note: str = ""

    def evaluate(self, rows: Rows, group: str) -> list[dict[str, Any]]:
        pairs = [
            p
            for p in peer_pairs(rows)
            if p["group"] == group
            and p["impl"] == self.impl
            and (self.schedule is None or p["schedule"] == self.schedule)
        ]
        ratios = [p[_PAIR[self.metric]] for p in pairs]
        worst = None if not pairs or None in ratios else max(ratios)
        what = "every pair" if self.schedule is None else f"{self.schedule}"
        name = f"{_PHRASE[self.metric]} <= {self.at_most:.2f}x {self.impl} ({what})"
        measured = ", ".join(
            f"{p['ours']} / {p['peer']} {p[_PAIR[self.metric]]:.3f}x"
            for p in pairs
            if p[_PAIR[self.metric]] is not None
        )
        on_cpu = any(r.get("device_kind") == "cpu" for r in rows if r["group"] == group)
        why = self.cpu_note if on_cpu else ""
        return (
            [_verdict(name, group, self.metric, self.at_most, worst, measured, why)]
            if pairs
            else []
        )


@dataclasses.dataclass(frozen=True)
class EveryCheckpoint:
    """Every checkpoint (but `skip`) uses at most `None`'s temp memory plus
    `layers` layers' parameters."""

    on: Any
    layers: int = 0
    skip: tuple[str, ...] = ("None", "everything")

    def evaluate(self, rows: Rows, group: str, preset: _models.Preset) -> list[dict]:
        ours = _ours(rows, group)
        base = ours.get("None", {}).get("temp_bytes")
        others = [
            r
            for c, r in ours.items()
            if c not in self.skip and r.get("temp_bytes") is not None
        ]
        if not base or not others:
            return []
        slack = self.layers * preset.layer_param_bytes()
        worst = max(others, key=lambda r: r["temp_bytes"])
        x = worst["temp_bytes"] / (base + slack)  # of what is allowed
        extra = f" + {self.layers} layers' parameters" if self.layers else ""
        name = f"every checkpoint's temp memory <= None's{extra}"
        measured = (
            f"largest: {worst['checkpoint']} at "
            f"{worst['temp_bytes'] / base:.3f}x None"
            + (f", {x:.3f}x the allowance" if self.layers else "")
        )
        why = ""
        if not self.layers and group in PARAMS:
            why = (
                "the strict form; on a parameter-dominated stack the target is "
                "the relaxed one below (+ 2 layers' parameters): a checkpoint "
                "may hold a layer's parameters or their gradient once more"
            )
        return [_verdict(name, group, "temp_bytes", 1.0, x, measured, why)]


NOISY = "CPU timings on a shared 2-core machine are noisy"
PARAMS = (
    "chain-params",
    "chain-params-novmap",
    "chain-params-tiny",
    "chain-v5e-params",
)
TARGETS = (
    VsNone(_models.TransformerPreset, "dots", "temp_bytes", 0.60),
    VsNone(_models.TransformerPreset, "nothing", "temp_bytes", 0.30),
    VsNone(_models.TransformerPreset, "dots", "flops", 1.10),
    VsPeer(_models.TransformerPreset, "hand-written", "temp_bytes", 1.02),
    VsPeer(_models.TransformerPreset, "flax", "temp_bytes", 1.00),
    VsPeer(_models.TransformerPreset, "hand-written", "step_s", 1.05, cpu_note=NOISY),
    VsPeer(_models.TransformerPreset, "flax", "step_s", 1.05, cpu_note=NOISY),
    VsPeer(_models.ChainPreset, "eqxi.scan", "temp_bytes", 0.85, "recursive"),
    VsPeer(_models.ChainPreset, "eqxi.scan", "step_s", 1.00, "recursive", NOISY),
    VsPeer(_models.ChainPreset, "eqxi.scan", "temp_bytes", 1.00, "binomial"),
    VsPeer(_models.ChainPreset, "eqxi.scan", "step_s", 1.00, "binomial", NOISY),
    EveryCheckpoint(_models.Preset),
    EveryCheckpoint(PARAMS, layers=2),
)


# --------------------------------------------------------------------------------------
# The planner's sweep (plan_sweep.py): rows of kind "pick" (one per budget) and
# "uniform" (one per uniform candidate).


def _picks(rows: Rows, group: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["group"] == group and r.get("kind") == "pick"]


def uniform_frontier(rows: Rows, group: str) -> list[dict[str, Any]]:
    """The compiled uniform candidates that no other beats in both memory and
    estimated time, least memory first."""
    uniform = sorted(
        (
            r
            for r in rows
            if r["group"] == group and r.get("kind") == "uniform" and r["compiled"]
        ),
        key=lambda r: (r["memory_bytes"], r["time_s"]),
    )
    out: list[dict[str, Any]] = []
    for r in uniform:
        if not out or r["time_s"] < out[-1]["time_s"]:
            out.append(r)
    return out


def between_uniform(rows: Rows, group: str, budget: int) -> bool:
    """Whether `budget` lies strictly between the memories of two neighbours on
    the uniform candidates' frontier (where a mix can cost less than both)."""
    memories = [r["memory_bytes"] for r in uniform_frontier(rows, group)]
    return any(lo < budget < hi for lo, hi in zip(memories, memories[1:]))


NOTHING_BETWEEN = (
    "no budget lies between two uniform checkpoints of the frontier: one of them "
    "is both the smallest and the fastest"
)


@dataclasses.dataclass(frozen=True)
class PickFits:
    """At every budget the planner's pick fits when compiled: the largest
    compiled memory / budget is at most 1."""

    on: Any

    def evaluate(self, rows: Rows, group: str) -> list[dict[str, Any]]:
        picks = _picks(rows, group)
        if not picks:
            return []
        ratios = [
            math.inf if not r["fits"] else r["compiled_bytes"] / r["budget_bytes"]
            for r in picks
        ]
        worst = max(ratios)
        misses = sum(not r["fits"] for r in picks)
        measured = (
            f"{len(picks) - misses} of {len(picks)} budgets; largest "
            + ("n/a" if math.isinf(worst) else f"{worst:.3f}x")
            + " of the budget"
        )
        name = "at every budget the pick fits when compiled"
        return [_verdict(name, group, "memory_bytes", 1.0, worst, measured)]


@dataclasses.dataclass(frozen=True)
class PickVsUniform:
    """At every budget the pick's estimated step time is at most `at_most` x
    that of the best uniform candidate that fits."""

    on: Any
    at_most: float = 1.0 + 1e-9

    def evaluate(self, rows: Rows, group: str) -> list[dict[str, Any]]:
        picks = [
            r for r in _picks(rows, group) if r.get("best_uniform_time_s") is not None
        ]
        if not picks:
            return []
        ratios = [
            (r["time_s"] / r["best_uniform_time_s"]) if r.get("time_s") else math.inf
            for r in picks
        ]
        worst = max(ratios)
        name = "pick's est. time <= best fitting uniform candidate's (every budget)"
        measured = f"{worst:.3f}x at worst ({len(picks)} budgets)"
        return [_verdict(name, group, "time_s", self.at_most, worst, measured)]


@dataclasses.dataclass(frozen=True)
class CheaperBetween:
    """At `at_least` of the budgets between uniform points (`between_uniform`),
    the pick costs strictly less than the best uniform candidate that fits."""

    on: Any
    at_least: float = 0.5

    def evaluate(self, rows: Rows, group: str) -> list[dict[str, Any]]:
        picks = _picks(rows, group)
        if not picks:
            return []
        between = [r for r in picks if between_uniform(rows, group, r["budget_bytes"])]
        cheaper = [
            r
            for r in between
            if r.get("time_s") is not None
            and r["time_s"] < r["best_uniform_time_s"] * (1 - 1e-6)
        ]
        share = len(cheaper) / len(between) if between else None
        gains = [1 - r["time_s"] / r["best_uniform_time_s"] for r in cheaper]
        measured = f"{len(cheaper)} of {len(between)} budgets" + (
            f" ({100 * min(gains):.1f}%–{100 * max(gains):.1f}% less time)"
            if gains
            else ""
        )
        name = (
            f"pick strictly cheaper at >= {self.at_least:.0%} of the budgets "
            "between uniform points"
        )
        return [
            _verdict(
                name,
                group,
                "time_s",
                self.at_least,
                share,
                measured,
                "" if between else NOTHING_BETWEEN,
                at_least=True,
            )
        ]


@dataclasses.dataclass(frozen=True)
class PredictedWithin:
    """Every compiled pick's predicted memory is within `rel` of its compiled
    memory: the largest |predicted - compiled| / compiled."""

    on: Any
    rel: float = 0.05

    def evaluate(self, rows: Rows, group: str) -> list[dict[str, Any]]:
        picks = [
            r
            for r in _picks(rows, group)
            if r.get("compiled_bytes") and r.get("predicted_bytes") is not None
        ]
        if not picks:
            return []
        errors = [
            abs(r["predicted_bytes"] - r["compiled_bytes"]) / r["compiled_bytes"]
            for r in picks
        ]
        worst = max(errors)
        name = f"pick's predicted memory within {self.rel:.0%} of compiled"
        measured = f"{100 * worst:.2f}% at worst ({len(picks)} picks)"
        return [_verdict(name, group, "memory_bytes", self.rel, worst, measured)]


@dataclasses.dataclass(frozen=True)
class PlanningCost:
    """Planning every budget of the sweep takes at most `compiles` full
    compiles and `seconds` of wall time (on the machine that ran it)."""

    on: Any
    compiles: int = 30
    seconds: float = 600.0

    def evaluate(self, rows: Rows, group: str) -> list[dict[str, Any]]:
        runs = [r for r in rows if r["group"] == group and r["kind"] == "planning"]
        if not runs:
            return []
        (r,) = runs
        worst = max(r["compiles"] / self.compiles, r["seconds"] / self.seconds)
        name = (
            f"{r['budgets']} budgets planned in <= {self.compiles} compiles and "
            f"<= {self.seconds / 60:.0f} minutes"
        )
        measured = (
            f"{r['compiles']} compiles, {r['seconds']:.0f} s "
            f"(load average {r['load_average']:.1f})"
        )
        return [_verdict(name, group, "compiles", 1.0, worst, measured)]


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation of `xs` and `ys` (ties share their mean
    rank); `None` for fewer than 3 points or a constant side."""
    if len(xs) < 3:
        return None

    def ranks(v: Sequence[float]) -> np.ndarray:
        v = np.asarray(v, dtype=float)
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for value in np.unique(v):  # ties: their mean rank
            r[v == value] = r[v == value].mean()
        return r

    a, b = ranks(xs), ranks(ys)
    if a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def between_measured(timed: Rows, budget: int) -> bool:
    """Whether `budget` lies strictly between the memories of two neighbours on
    the frontier of the uniform checkpoints as measured (timed rows)."""
    uniform = sorted(
        (r for r in timed if r["uniform"]),
        key=lambda r: (r["memory_bytes"], r["measured_s"]),
    )
    front: list[dict[str, Any]] = []
    for r in uniform:
        if not front or r["measured_s"] < front[-1]["measured_s"]:
            front.append(r)
    memories = [r["memory_bytes"] for r in front]
    return any(lo < budget < hi for lo, hi in zip(memories, memories[1:]))


def clock_ratio(pick: dict[str, Any]) -> float:
    """The pick's measured time over the fastest fitting uniform checkpoint's:
    the median of their rounds' ratios where the row has it."""
    if pick.get("clock_ratio") is not None:
        return pick["clock_ratio"]
    return pick["measured_s"] / pick["best_uniform_measured_s"]


def _clock_picks(rows: Rows, group: str) -> list[dict[str, Any]]:
    return [r for r in _picks(rows, group) if r.get("best_uniform_measured_s")]


@dataclasses.dataclass(frozen=True)
class ClockPickVsUniform:
    """By the clock, at every budget: the pick's measured step time is at
    most `at_most` x that of the fastest uniform checkpoint that fits,
    measured in the same interleaved rounds."""

    on: Any
    at_most: float = 1.03

    def evaluate(self, rows: Rows, group: str) -> list[dict[str, Any]]:
        picks = _clock_picks(rows, group)
        if not picks:
            return []
        ratios = [clock_ratio(r) for r in picks]
        worst = max(ratios)
        spread = max(r["spread"] for r in picks)
        name = (
            f"measured: pick <= {self.at_most:.2f}x the fastest fitting uniform "
            "checkpoint (every budget)"
        )
        measured = (
            f"{worst:.3f}x at worst, {min(ratios):.3f}x at best ({len(picks)} "
            f"budgets; spread up to {100 * spread:.1f}%)"
        )
        return [_verdict(name, group, "step_s", self.at_most, worst, measured)]


@dataclasses.dataclass(frozen=True)
class ClockFasterBetween:
    """By the clock: at `at_least` of the budgets between uniform points, the
    pick is strictly faster than the fastest uniform checkpoint that fits."""

    on: Any
    at_least: float = 0.5

    def evaluate(self, rows: Rows, group: str) -> list[dict[str, Any]]:
        picks = _clock_picks(rows, group)
        if not picks:
            return []
        between = [r for r in picks if r.get("clock_between")]
        faster = [r for r in between if clock_ratio(r) < 1.0]
        share = len(faster) / len(between) if between else None
        gains = [1 - clock_ratio(r) for r in faster]
        measured = f"{len(faster)} of {len(between)} budgets" + (
            f" ({100 * min(gains):.1f}%–{100 * max(gains):.1f}% less time)"
            if gains
            else ""
        )
        name = (
            f"measured: pick faster at >= {self.at_least:.0%} of the budgets "
            "between uniform points"
        )
        return [
            _verdict(
                name,
                group,
                "step_s",
                self.at_least,
                share,
                measured,
                "" if between else NOTHING_BETWEEN,
                at_least=True,
            )
        ]


@dataclasses.dataclass(frozen=True)
class RankCorrelation:
    """Over every checkpoint timed afresh (the frontier's points, the picks
    and the uniform candidates: the frontier by the clock alone has two or
    three points, too few to rank): Spearman's rank correlation of `key` (the
    planner's predicted time, or the roofline's) with the measured time is
    at least `at_least`."""

    on: Any
    key: str = "predicted_s"
    at_least: float = 0.9

    def evaluate(self, rows: Rows, group: str) -> list[dict[str, Any]]:
        timed = [r for r in rows if r["group"] == group and r["kind"] == "timed"]
        if not timed:
            return []
        rho = spearman([r[self.key] for r in timed], [r["measured_s"] for r in timed])
        front = [r for r in timed if r["on_frontier"]]
        on = spearman([r[self.key] for r in front], [r["measured_s"] for r in front])
        what = "predicted" if self.key == "predicted_s" else "roofline"
        name = (
            f"{what} times rank the timed checkpoints as measured ones do "
            f"(Spearman >= {self.at_least})"
        )
        measured = (
            ("n/a" if rho is None else f"{rho:.3f}")
            + f" over {len(timed)} timed; "
            + ("n/a" if on is None else f"{on:.3f}")
            + f" over the {len(front)} on the frontier"
        )
        return [
            _verdict(name, group, "step_s", self.at_least, rho, measured, at_least=True)
        ]


@dataclasses.dataclass(frozen=True)
class BatchPickVsCombinations:
    """By the clock, at every budget: the planner's (micro-batches, loss
    chunking, checkpoint) fits, and runs a global batch in at most `at_most`
    x the time of the fastest (uniform checkpoint x micro-batches x loss
    chunking) that fits, timed in the same interleaved rounds."""

    on: Any
    at_most: float = 1.03

    def evaluate(self, rows: Rows, group: str) -> list[dict[str, Any]]:
        picks = _picks(rows, group)
        if not picks:
            return []
        worst = max(r["ratio"] for r in picks)
        value = worst if all(r["fits"] for r in picks) else math.inf
        name = (
            f"measured: pick <= {self.at_most:.2f}x the fastest fitting (uniform "
            "checkpoint x micro-batches x loss chunking), every budget"
        )
        spread = max(r["spread"] for r in picks)
        measured = (
            f"{worst:.3f}x at worst, {min(r['ratio'] for r in picks):.3f}x at best "
            f"({len(picks)} budgets; spread up to {100 * spread:.1f}%)"
        )
        return [_verdict(name, group, "step_s", self.at_most, value, measured)]


@dataclasses.dataclass(frozen=True)
class BatchPlanningCost:
    """Planning a batch costs at most `at_most` x a checkpoint-only plan of
    the same model and budget, both from an empty plan cache."""

    on: Any
    at_most: float = 3.0

    def evaluate(self, rows: Rows, group: str) -> list[dict[str, Any]]:
        timed = [r for r in _picks(rows, group) if r.get("plain_plan_s")]
        if not timed:
            return []
        r = timed[0]
        x = r["plan_s"] / r["plain_plan_s"]
        name = f"planning a batch <= {self.at_most:.0f}x a checkpoint-only plan"
        measured = f"{x:.2f}x ({r['plan_s']:.0f} s vs {r['plain_plan_s']:.0f} s)"
        return [_verdict(name, group, "seconds", self.at_most, x, measured)]


BATCH_TARGETS = (
    BatchPickVsCombinations(_models.Preset),
    BatchPlanningCost(_models.Preset),
)


PLAN_TARGETS = (
    PickFits(_models.Preset),
    PickVsUniform(_models.Preset),
    CheaperBetween(_models.Preset),
    PredictedWithin(_models.Preset),
    PlanningCost(_models.Preset),
    ClockPickVsUniform(_models.Preset),
    ClockFasterBetween(_models.Preset),
    RankCorrelation(_models.Preset),
    RankCorrelation(_models.Preset, key="roofline_s", at_least=0.8),
)


# --------------------------------------------------------------------------------------

_PAIR = {"temp_bytes": "temp_ratio", "flops": "flops_ratio", "step_s": "time_ratio"}


def peer_pairs(rows: Rows) -> list[dict[str, Any]]:
    """Each peer row beside each of our rows it is compared with (the peer's
    `compared_with`): ratios ours / peer, and both losses."""
    out = []
    for p in rows:
        for spec in p.get("compared_with", ()):
            o = _ours(rows, p["group"]).get(spec)
            if o is None:
                continue
            pair = {
                "group": p["group"],
                "ours": spec,
                "schedule": o["schedule"],
                "impl": p["impl"],
                "peer": f"{p['impl']} {p['checkpoint']}",
            }
            for metric, key in _PAIR.items():
                pair[key] = _ratio(o, p, metric)
            if o.get("loss") is not None and p.get("loss") is not None:
                diff = abs(o["loss"] - p["loss"])
                pair |= {
                    "loss_abs_diff": diff,
                    "losses_equal": diff <= 1e-4 * max(1.0, abs(o["loss"])),
                }
            out.append(pair)
    return out


def evaluate(
    rows: Rows, presets: dict[str, _models.Preset], targets: Sequence = TARGETS
) -> list[dict[str, Any]]:
    """Every target (of `targets`, default `TARGETS`) on every preset it
    applies to, in their order."""
    out = []
    for t in targets:
        for name, preset in presets.items():
            if not _selects(t.on, name, preset):
                continue
            if isinstance(t, EveryCheckpoint):
                out += t.evaluate(rows, name, preset)
            else:
                out += t.evaluate(rows, name)
    return out

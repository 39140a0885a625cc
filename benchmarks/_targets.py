"""The project's performance targets, defined once as data: what is measured,
the threshold, and on which presets. The script that measures evaluates them on
its rows and stores the verdicts in its JSON; `report.py` only formats them.

A verdict is `met: true/false`, or `null` where this run could not measure the
figure (no timings when compiling for a TPU ahead of time).
"""

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _models


Rows = Sequence[dict[str, Any]]
_PHRASE = {"temp_bytes": "temp memory", "flops": "FLOPs", "step_s": "step time"}
_PAIR = {"temp_bytes": "temp_ratio", "flops": "flops_ratio", "step_s": "time_ratio"}


def _ours(rows: Rows, group: str) -> dict[str, dict[str, Any]]:
    return {
        r["checkpoint"]: r
        for r in rows
        if r["group"] == group and r["impl"] == "eqx_remat"
    }


def _picks(rows: Rows, group: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["group"] == group and r.get("kind") == "pick"]


def _ratio(a: dict | None, b: dict | None, metric: str) -> float | None:
    if not a or not b or a.get(metric) is None or not b.get(metric):
        return None
    return a[metric] / b[metric]


def _verdict(name, group, metric, limit, value, measured, why="", at_least=False):
    """One verdict: `value` against `limit` (at most, or `at_least`)."""
    met = (
        None if value is None else bool(value >= limit if at_least else value <= limit)
    )
    return [
        {
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
    ]


# --------------------------------------------------------------------------------------
# The evaluators: `check(rows, group, preset, *params)` -> the verdicts (none where
# the run did not measure what the target needs).


def vs_none(rows, group, preset, checkpoint: str, metric: str, at_most: float):
    """Our `checkpoint`'s `metric` is at most `at_most` x `None`'s."""
    ours = _ours(rows, group)
    if checkpoint not in ours or "None" not in ours:
        return []
    x = _ratio(ours[checkpoint], ours["None"], metric)
    name = f"{checkpoint!r} {_PHRASE[metric]} <= {at_most:.2f}x None"
    return _verdict(name, group, metric, at_most, x, "" if x is None else f"{x:.3f}x")


def vs_peer(rows, group, preset, impl, metric, at_most, schedule=None, cpu_note=""):
    """Ours / a peer's `metric`, for every pair with peers of `impl` (only our
    schedules of kind `schedule`, if given), at most `at_most`. `cpu_note` is
    said beside the verdict when the group's rows were measured on a CPU."""
    pairs = [
        p
        for p in peer_pairs(rows)
        if p["group"] == group
        and p["impl"] == impl
        and (schedule is None or p["schedule"] == schedule)
    ]
    if not pairs:
        return []
    key = _PAIR[metric]
    ratios = [p[key] for p in pairs]
    worst = None if None in ratios else max(ratios)
    what = "every pair" if schedule is None else schedule
    name = f"{_PHRASE[metric]} <= {at_most:.2f}x {impl} ({what})"
    measured = ", ".join(
        f"{p['ours']} / {p['peer']} {p[key]:.3f}x" for p in pairs if p[key] is not None
    )
    on_cpu = any(r.get("device_kind") == "cpu" for r in rows if r["group"] == group)
    return _verdict(
        name, group, metric, at_most, worst, measured, cpu_note if on_cpu else ""
    )


def every_checkpoint(rows, group, preset, layers=0, skip=("None", "everything")):
    """Every checkpoint (but `skip`) uses at most `None`'s temp memory plus
    `layers` layers' parameters."""
    ours = _ours(rows, group)
    base = ours.get("None", {}).get("temp_bytes")
    others = [
        r for c, r in ours.items() if c not in skip and r.get("temp_bytes") is not None
    ]
    if not base or not others:
        return []
    worst = max(others, key=lambda r: r["temp_bytes"])
    x = worst["temp_bytes"] / (base + layers * preset.layer_param_bytes())
    extra = f" + {layers} layers' parameters" if layers else ""
    measured = (
        f"largest: {worst['checkpoint']} at {worst['temp_bytes'] / base:.3f}x None"
    )
    measured += f", {x:.3f}x the allowance" if layers else ""
    why = ""
    if not layers and group in PARAMS:
        why = (
            "the strict form; on a parameter-dominated stack the target is "
            "the relaxed one below (+ 2 layers' parameters): a checkpoint "
            "may hold a layer's parameters or their gradient once more"
        )
    name = f"every checkpoint's temp memory <= None's{extra}"
    return _verdict(name, group, "temp_bytes", 1.0, x, measured, why)


# The planner's sweep (plan_sweep.py): rows of kind "pick" (one per budget),
# "uniform" (one per uniform candidate), "planning" and "timed".

NOTHING_BETWEEN = (
    "no budget lies between two uniform checkpoints of the frontier: one of them "
    "is both the smallest and the fastest"
)


def pareto(rows: Rows, time: str) -> list[dict[str, Any]]:
    """The rows no other beats in both memory (`memory_bytes`) and `time`, least
    memory first (of equals, the first)."""
    out: list[dict[str, Any]] = []
    for r in sorted(rows, key=lambda r: (r["memory_bytes"], r[time])):
        if not out or r[time] < out[-1][time]:
            out.append(r)
    return out


def _between(front: Rows, budget: int) -> bool:
    memories = [r["memory_bytes"] for r in front]
    return any(lo < budget < hi for lo, hi in zip(memories, memories[1:]))


def uniform_frontier(rows: Rows, group: str) -> list[dict[str, Any]]:
    """The compiled uniform candidates that no other beats in both memory and
    estimated time, least memory first."""
    uniform = [
        r
        for r in rows
        if r["group"] == group and r.get("kind") == "uniform" and r["compiled"]
    ]
    return pareto(uniform, "time_s")


def between_uniform(rows: Rows, group: str, budget: int) -> bool:
    """Whether `budget` lies strictly between the memories of two neighbours on
    the uniform candidates' frontier (where a mix can cost less than both)."""
    return _between(uniform_frontier(rows, group), budget)


def between_measured(timed: Rows, budget: int) -> bool:
    """Whether `budget` lies strictly between the memories of two neighbours on
    the frontier of the uniform checkpoints as measured (timed rows)."""
    return _between(pareto([r for r in timed if r["uniform"]], "measured_s"), budget)


def clock_ratio(pick: dict[str, Any]) -> float:
    """The pick's measured time over the fastest fitting uniform checkpoint's:
    the median of their rounds' ratios where the row has it."""
    if pick.get("clock_ratio") is not None:
        return pick["clock_ratio"]
    return pick["measured_s"] / pick["best_uniform_measured_s"]


def _share(name, group, metric, at_least, between, gains):
    """At `at_least` of the budgets `between` uniform points, the pick wins
    (`gains`: its fractions of time saved where it does)."""
    share = len(gains) / len(between) if between else None
    measured = f"{len(gains)} of {len(between)} budgets" + (
        f" ({100 * min(gains):.1f}%–{100 * max(gains):.1f}% less time)" if gains else ""
    )
    why = "" if between else NOTHING_BETWEEN
    return _verdict(name, group, metric, at_least, share, measured, why, True)


def pick_fits(rows, group, preset):
    """At every budget the planner's pick fits when compiled: the largest
    compiled memory / budget is at most 1."""
    picks = _picks(rows, group)
    if not picks:
        return []
    worst = max(
        math.inf if not r["fits"] else r["compiled_bytes"] / r["budget_bytes"]
        for r in picks
    )
    misses = sum(not r["fits"] for r in picks)
    measured = (
        f"{len(picks) - misses} of {len(picks)} budgets; largest "
        + ("n/a" if math.isinf(worst) else f"{worst:.3f}x")
        + " of the budget"
    )
    name = "at every budget the pick fits when compiled"
    return _verdict(name, group, "memory_bytes", 1.0, worst, measured)


def pick_vs_uniform(rows, group, preset, at_most=1.0 + 1e-9):
    """At every budget the pick's estimated step time is at most `at_most` x
    that of the best uniform candidate that fits."""
    picks = [r for r in _picks(rows, group) if r.get("best_uniform_time_s") is not None]
    if not picks:
        return []
    worst = max(
        (r["time_s"] / r["best_uniform_time_s"]) if r.get("time_s") else math.inf
        for r in picks
    )
    name = "pick's est. time <= best fitting uniform candidate's (every budget)"
    measured = f"{worst:.3f}x at worst ({len(picks)} budgets)"
    return _verdict(name, group, "time_s", at_most, worst, measured)


def cheaper_between(rows, group, preset, at_least=0.5):
    """At `at_least` of the budgets between uniform points (`between_uniform`),
    the pick costs strictly less than the best uniform candidate that fits."""
    picks = _picks(rows, group)
    if not picks:
        return []
    between = [r for r in picks if between_uniform(rows, group, r["budget_bytes"])]
    gains = [
        1 - r["time_s"] / r["best_uniform_time_s"]
        for r in between
        if r.get("time_s") is not None
        and r["time_s"] < r["best_uniform_time_s"] * (1 - 1e-6)
    ]
    name = (
        f"pick strictly cheaper at >= {at_least:.0%} of the budgets "
        "between uniform points"
    )
    return _share(name, group, "time_s", at_least, between, gains)


def predicted_within(rows, group, preset, rel=0.05):
    """Every compiled pick's predicted memory is within `rel` of its compiled
    memory: the largest |predicted - compiled| / compiled."""
    picks = [
        r
        for r in _picks(rows, group)
        if r.get("compiled_bytes") and r.get("predicted_bytes") is not None
    ]
    if not picks:
        return []
    worst = max(
        abs(r["predicted_bytes"] - r["compiled_bytes"]) / r["compiled_bytes"]
        for r in picks
    )
    name = f"pick's predicted memory within {rel:.0%} of compiled"
    measured = f"{100 * worst:.2f}% at worst ({len(picks)} picks)"
    return _verdict(name, group, "memory_bytes", rel, worst, measured)


def planning_cost(rows, group, preset, compiles=30, seconds=600.0):
    """Planning every budget of the sweep takes at most `compiles` full
    compiles and `seconds` of wall time (on the machine that ran it)."""
    runs = [r for r in rows if r["group"] == group and r["kind"] == "planning"]
    if not runs:
        return []
    (r,) = runs
    worst = max(r["compiles"] / compiles, r["seconds"] / seconds)
    name = (
        f"{r['budgets']} budgets planned in <= {compiles} compiles and "
        f"<= {seconds / 60:.0f} minutes"
    )
    measured = (
        f"{r['compiles']} compiles, {r['seconds']:.0f} s "
        f"(load average {r['load_average']:.1f})"
    )
    return _verdict(name, group, "compiles", 1.0, worst, measured)


def _raced(group, picks, ratios, at_most, value, rivals):
    """The pick against the fastest of `rivals` that fits, at every budget:
    `ratios`, its time over that one's in the same interleaved rounds."""
    spread = max(r["spread"] for r in picks)
    name = f"measured: pick <= {at_most:.2f}x the fastest fitting {rivals}"
    measured = (
        f"{max(ratios):.3f}x at worst, {min(ratios):.3f}x at best "
        f"({len(picks)} budgets; spread up to {100 * spread:.1f}%)"
    )
    return _verdict(name, group, "step_s", at_most, value, measured)


def _clock_picks(rows: Rows, group: str) -> list[dict[str, Any]]:
    return [r for r in _picks(rows, group) if r.get("best_uniform_measured_s")]


def clock_pick_vs_uniform(rows, group, preset, at_most=1.03):
    """By the clock, at every budget: the pick's measured step time is at
    most `at_most` x that of the fastest uniform checkpoint that fits,
    measured in the same interleaved rounds."""
    picks = _clock_picks(rows, group)
    if not picks:
        return []
    ratios = [clock_ratio(r) for r in picks]
    rivals = "uniform checkpoint (every budget)"
    return _raced(group, picks, ratios, at_most, max(ratios), rivals)


def clock_faster_between(rows, group, preset, at_least=0.5):
    """By the clock: at `at_least` of the budgets between uniform points, the
    pick is strictly faster than the fastest uniform checkpoint that fits."""
    picks = _clock_picks(rows, group)
    if not picks:
        return []
    between = [r for r in picks if r.get("clock_between")]
    gains = [1 - clock_ratio(r) for r in between if clock_ratio(r) < 1.0]
    name = (
        f"measured: pick faster at >= {at_least:.0%} of the budgets "
        "between uniform points"
    )
    return _share(name, group, "step_s", at_least, between, gains)


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation of `xs` and `ys` (ties share their mean
    rank); `None` for fewer than 3 points or a constant side."""
    if len(xs) < 3:
        return None

    def ranks(v: Sequence[float]) -> np.ndarray:
        v = np.asarray(v, dtype=float)
        r = np.empty(len(v))
        r[np.argsort(v, kind="stable")] = np.arange(len(v))
        for value in np.unique(v):  # ties: their mean rank
            r[v == value] = r[v == value].mean()
        return r

    a, b = ranks(xs), ranks(ys)
    if a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def rank_correlation(rows, group, preset, key="predicted_s", at_least=0.9):
    """Over every checkpoint timed afresh (the frontier's points, the picks
    and the uniform candidates: the frontier by the clock alone has two or
    three points, too few to rank): Spearman's rank correlation of `key` (the
    planner's predicted time, or the roofline's) with the measured time is
    at least `at_least`."""
    timed = [r for r in rows if r["group"] == group and r["kind"] == "timed"]
    if not timed:
        return []
    rho = spearman([r[key] for r in timed], [r["measured_s"] for r in timed])
    front = [r for r in timed if r["on_frontier"]]
    on = spearman([r[key] for r in front], [r["measured_s"] for r in front])
    what = "predicted" if key == "predicted_s" else "roofline"
    name = (
        f"{what} times rank the timed checkpoints as measured ones do "
        f"(Spearman >= {at_least})"
    )
    measured = (
        ("n/a" if rho is None else f"{rho:.3f}")
        + f" over {len(timed)} timed; "
        + ("n/a" if on is None else f"{on:.3f}")
        + f" over the {len(front)} on the frontier"
    )
    return _verdict(name, group, "step_s", at_least, rho, measured, at_least=True)


def batch_pick_vs_combinations(rows, group, preset, at_most=1.03):
    """By the clock, at every budget: the planner's (micro-batches, loss
    chunking, checkpoint) fits, and runs a global batch in at most `at_most`
    x the time of the fastest (uniform checkpoint x micro-batches x loss
    chunking) that fits, timed in the same interleaved rounds."""
    picks = _picks(rows, group)
    if not picks:
        return []
    ratios = [r["ratio"] for r in picks]
    value = max(ratios) if all(r["fits"] for r in picks) else math.inf
    rivals = "(uniform checkpoint x micro-batches x loss chunking), every budget"
    return _raced(group, picks, ratios, at_most, value, rivals)


def batch_planning_cost(rows, group, preset, at_most=3.0):
    """Planning a batch costs at most `at_most` x a checkpoint-only plan of
    the same model and budget, both from an empty plan cache."""
    timed = [r for r in _picks(rows, group) if r.get("plain_plan_s")]
    if not timed:
        return []
    r = timed[0]
    x = r["plan_s"] / r["plain_plan_s"]
    name = f"planning a batch <= {at_most:.0f}x a checkpoint-only plan"
    measured = f"{x:.2f}x ({r['plan_s']:.0f} s vs {r['plain_plan_s']:.0f} s)"
    return _verdict(name, group, "seconds", at_most, x, measured)


# --------------------------------------------------------------------------------------
# The targets: (presets, evaluator, its parameters); presets are a Preset type,
# or preset names.

NOISY = "CPU timings on a shared 2-core machine are noisy"
PARAMS = (
    "chain-params",
    "chain-params-novmap",
    "chain-params-tiny",
    "chain-v5e-params",
)
TARGETS = (
    (_models.TransformerPreset, vs_none, "dots", "temp_bytes", 0.60),
    (_models.TransformerPreset, vs_none, "nothing", "temp_bytes", 0.30),
    (_models.TransformerPreset, vs_none, "dots", "flops", 1.10),
    (_models.TransformerPreset, vs_peer, "hand-written", "temp_bytes", 1.02),
    (_models.TransformerPreset, vs_peer, "flax", "temp_bytes", 1.00),
    (_models.TransformerPreset, vs_peer, "hand-written", "step_s", 1.05, None, NOISY),
    (_models.TransformerPreset, vs_peer, "flax", "step_s", 1.05, None, NOISY),
    (_models.ChainPreset, vs_peer, "eqxi.scan", "temp_bytes", 0.85, "recursive"),
    (_models.ChainPreset, vs_peer, "eqxi.scan", "step_s", 1.00, "recursive", NOISY),
    (_models.ChainPreset, vs_peer, "eqxi.scan", "temp_bytes", 1.00, "binomial"),
    (_models.ChainPreset, vs_peer, "eqxi.scan", "step_s", 1.00, "binomial", NOISY),
    (_models.Preset, every_checkpoint),
    (PARAMS, every_checkpoint, 2),
)
PLAN_TARGETS = (
    (_models.Preset, pick_fits),
    (_models.Preset, pick_vs_uniform),
    (_models.Preset, cheaper_between),
    (_models.Preset, predicted_within),
    (_models.Preset, planning_cost),
    (_models.Preset, clock_pick_vs_uniform),
    (_models.Preset, clock_faster_between),
    (_models.Preset, rank_correlation),
    (_models.Preset, rank_correlation, "roofline_s", 0.8),
)
BATCH_TARGETS = (
    (_models.Preset, batch_pick_vs_combinations),
    (_models.Preset, batch_planning_cost),
)


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
            pair |= {key: _ratio(o, p, metric) for metric, key in _PAIR.items()}
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
    for on, check, *params in targets:
        for name, preset in presets.items():
            if isinstance(preset, on) if isinstance(on, type) else name in on:
                out += check(rows, name, preset, *params)
    return out

"""The project's performance targets, as data: what is measured, the threshold,
on which presets. `evaluate(rows, presets)` gives the verdicts the measuring
scripts store in their JSON (`report.py` only formats them): `met` is
true/false, or `null` where the run could not measure the figure.
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from . import _format, _models
from ._results import of_kind


Rows = Sequence[dict[str, Any]]
Verdict = dict[str, Any]
_PHRASE = {"temp_bytes": "temp memory", "flops": "FLOPs", "step_s": "step time"}
_PAIR = {"temp_bytes": "temp_ratio", "flops": "flops_ratio", "step_s": "time_ratio"}
NOISY = "CPU timings on a shared 2-core machine are noisy"
NOTHING_BETWEEN = (
    "no budget lies between two uniform checkpoints of the frontier: one of them "
    "is both the smallest and the fastest"
)
NOTHING_BETWEEN_SAME = (
    "no budget lies between two combinations that put one checkpoint on every "
    "stack on their measured frontier: one of them is both the smallest and the "
    "fastest"
)


def _ours(rows: Rows, group: str) -> dict[str, dict[str, Any]]:
    return {
        r["checkpoint"]: r
        for r in rows
        if r["group"] == group and r["impl"] == "eqx_remat"
    }


def _ratio(a: dict | None, b: dict | None, metric: str) -> float | None:
    if not a or not b or a.get(metric) is None or not b.get(metric):
        return None
    return a[metric] / b[metric]


def _verdict(target, metric, threshold, value, measured, why="", at_least=False):
    """`value` against `threshold`: at most it, or `at_least`."""
    if value is None:
        met, measured = None, "not measured here"
    else:
        met = bool(value >= threshold if at_least else value <= threshold)
    return dict(
        target=target,
        metric=metric,
        threshold=threshold,
        value=value,
        met=met,
        measured=measured,
        why=why,
    )


def _check(kind: str | None = None, *needs: str) -> Callable[[Callable], Callable]:
    """`judge(rows, group, preset, *params)` as a check: `check(rows, group,
    preset, *params)` -> its verdicts, named after `group`. The judge is given
    `group`'s rows (of `kind` only, and with every key of `needs` set, where
    given); none where it has no rows or says `None`: the run did not measure
    what the target needs."""

    def wrap(judge: Callable[..., Verdict | None]) -> Callable[..., list[Verdict]]:
        @functools.wraps(judge)
        def check(rows: Rows, group: str, preset: Any, *params: Any) -> list[Verdict]:
            mine = [
                r
                for r in rows
                if r["group"] == group
                and kind in (None, r.get("kind"))
                and all(r.get(k) is not None for k in needs)
            ]
            v = judge(mine, group, preset, *params) if mine else None
            if v is None:
                return []
            name = f"{group}: {v['target']}"
            return [{"name": name, "target": "", "preset": group} | v]

        return check

    return wrap


# --------------------------------------------------------------------------------------
# The sweep's targets (run.py, seed_claim.py).


@_check()
def vs_none(rows, group, preset, checkpoint: str, metric: str, at_most: float):
    """Our `checkpoint`'s `metric` is at most `at_most` x `None`'s."""
    ours = _ours(rows, group)
    if checkpoint not in ours or "None" not in ours:
        return None
    x = _ratio(ours[checkpoint], ours["None"], metric)
    name = f"{checkpoint!r} {_PHRASE[metric]} <= {at_most:.2f}x None"
    return _verdict(name, metric, at_most, x, "" if x is None else f"{x:.3f}x")


@_check()
def vs_peer(rows, group, preset, impl, metric, at_most, schedule=None, cpu_note=""):
    """Ours / peer `impl`'s `metric`, every pair (of our `schedule` only, if
    given), at most `at_most`; `cpu_note` is the note for CPU rows."""
    pairs = [
        p
        for p in peer_pairs(rows)
        if p["impl"] == impl and schedule in (None, p["schedule"])
    ]
    if not pairs:
        return None
    key = _PAIR[metric]
    ratios = [p[key] for p in pairs]
    name = f"{_PHRASE[metric]} <= {at_most:.2f}x {impl} ({schedule or 'every pair'})"
    measured = ", ".join(
        f"{p['ours']} / {p['peer']} {p[key]:.3f}x" for p in pairs if p[key] is not None
    )
    on_cpu = any(r.get("device_kind") == "cpu" for r in rows)
    worst = None if None in ratios else max(ratios)
    why = cpu_note if on_cpu else ""
    if metric == "temp_bytes" and worst and worst > at_most:
        why = parameter_dominated(rows, group, preset, impl) or why
    return _verdict(name, metric, at_most, worst, measured, why)


def parameter_dominated(rows: Rows, group: str, preset: Any, impl: str) -> str:
    """Why ours cannot beat peer `impl`'s temp memory by much where both use
    only a few layers' parameters of it (a wide, shallow stack at a tiny
    batch), said with the figures; else ""."""
    layer = preset.layer_param_bytes()
    peers = [r for r in rows if r["group"] == group and r["impl"] == impl]
    if not layer or not peers or peers[0].get("temp_bytes") is None:
        return ""
    layers = peers[0]["temp_bytes"] / layer
    if layers > 4:  # the carries matter here: no excuse
        return ""
    return (
        f"a parameter-dominated stack: {impl}'s temp memory is "
        f"{layers:.1f} layers' parameters "
        f"({_format.fmt_bytes(layer, digits=1)} a layer), a layer's parameters and "
        "their gradient; the carries, where the schedules differ, are a small "
        "part of it"
    )


@_check()
def every_checkpoint(rows, group, preset, layers=0, skip=("None", "everything")):
    """Every checkpoint but `skip` uses at most `None`'s temp memory plus `layers`
    layers' parameters (`preset.layer_param_bytes()`)."""
    ours = _ours(rows, group)
    base = ours.get("None", {}).get("temp_bytes")
    others = [
        r for c, r in ours.items() if c not in skip and r.get("temp_bytes") is not None
    ]
    if not base or not others:
        return None
    worst = max(others, key=lambda r: r["temp_bytes"])
    x = worst["temp_bytes"] / (base + layers * preset.layer_param_bytes())
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
    extra = f" + {layers} layers' parameters" if layers else ""
    name = f"every checkpoint's temp memory <= None's{extra}"
    return _verdict(name, "temp_bytes", 1.0, x, measured, why)


def peer_pairs(rows: Rows) -> list[dict[str, Any]]:
    """Each peer row beside each of our rows it is compared with (the peer's
    `compared_with`): ratios ours / peer, and both losses."""
    out = []
    for p in rows:
        for spec in p.get("compared_with", ()):
            o = _ours(rows, p["group"]).get(spec)
            if o is None:
                continue
            pair = {"group": p["group"], "ours": spec, "schedule": o["schedule"]}
            pair |= {"impl": p["impl"], "peer": f"{p['impl']} {p['checkpoint']}"}
            pair |= {key: _ratio(o, p, metric) for metric, key in _PAIR.items()}
            if o.get("loss") is not None and p.get("loss") is not None:
                diff = abs(o["loss"] - p["loss"])
                pair |= {
                    "loss_abs_diff": diff,
                    "losses_equal": diff <= 1e-4 * max(1.0, abs(o["loss"])),
                }
            out.append(pair)
    return out


# --------------------------------------------------------------------------------------
# The planner's targets (plan_sweep.py: rows of kind "pick", one per budget,
# "uniform", "planning", "timed"; batch_sweep.py: "pick", "combination").


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


def between_uniform(rows: Rows, group: str, budget: int) -> bool:
    """Whether `budget` lies strictly between the memories of two neighbours on
    the frontier of the compiled uniform candidates (estimated times)."""
    uniform = [r for r in of_kind(rows, "uniform") if r["group"] == group]
    return _between(pareto([r for r in uniform if r["compiled"]], "time_s"), budget)


def between_measured(timed: Rows, budget: int) -> bool:
    """The same on the uniform checkpoints as measured (`timed` rows)."""
    return _between(pareto([r for r in timed if r["uniform"]], "measured_s"), budget)


def between_same(same: Rows, budget: int) -> bool:
    """Several stacks: the same on the combinations that put one checkpoint on
    every stack, as measured (`same`: their `memory_bytes` and `measured_s`)."""
    return _between(pareto(same, "measured_s"), budget)


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation of `xs` and `ys` (ties share their mean
    rank); `None` for fewer than 3 points or a constant side."""
    import scipy.stats  # a second to import: not for report.py, which never ranks

    if len(xs) < 3 or min(len(set(xs)), len(set(ys))) < 2:
        return None
    return float(scipy.stats.spearmanr(xs, ys).statistic)


@_check("pick")
def pick_fits(picks, group, preset):
    """The largest compiled memory of a pick / its budget (`inf`: one does
    not fit) is at most 1."""
    worst = max(
        r["compiled_bytes"] / r["budget_bytes"] if r["fits"] else math.inf
        for r in picks
    )
    fitting = sum(r["fits"] for r in picks)
    largest = "n/a" if math.isinf(worst) else f"{worst:.3f}x"
    measured = f"{fitting} of {len(picks)} budgets; largest {largest} of the budget"
    name = "at every budget the pick fits when compiled"
    return _verdict(name, "memory_bytes", 1.0, worst, measured)


@_check("pick", "best_uniform_time_s")
def pick_vs_uniform(picks, group, preset, at_most=1.0 + 1e-9):
    """Every pick's estimated step time / the best fitting uniform candidate's."""
    worst = max(
        r["time_s"] / r["best_uniform_time_s"] if r.get("time_s") else math.inf
        for r in picks
    )
    name = "pick's est. time <= best fitting uniform candidate's (every budget)"
    measured = f"{worst:.3f}x at worst ({len(picks)} budgets)"
    return _verdict(name, "time_s", at_most, worst, measured)


@_check("pick", "compiled_bytes", "predicted_bytes")
def predicted_within(picks, group, preset, rel=0.05):
    """The largest |predicted - compiled| / compiled memory of a pick."""
    worst = max(
        abs(r["predicted_bytes"] - r["compiled_bytes"]) / r["compiled_bytes"]
        for r in picks
    )
    name = f"pick's predicted memory within {rel:.0%} of compiled"
    measured = f"{100 * worst:.2f}% at worst ({len(picks)} picks)"
    return _verdict(name, "memory_bytes", rel, worst, measured)


@_check("planning")
def planning_cost(runs, group, preset, compiles=30, seconds=600.0):
    """Planning every budget takes at most `compiles` compiles and `seconds`."""
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
    return _verdict(name, "compiles", 1.0, worst, measured)


def _share(name, metric, at_least, between, gains):
    """At `at_least` of the budgets `between` uniform points the pick wins
    (`gains`: its fractions of time saved where it does)."""
    share = len(gains) / len(between) if between else None
    measured = f"{len(gains)} of {len(between)} budgets" + (
        f" ({100 * min(gains):.1f}%–{100 * max(gains):.1f}% less time)" if gains else ""
    )
    why = "" if between else NOTHING_BETWEEN
    return _verdict(name, metric, at_least, share, measured, why, True)


@_check("pick", "between")
def cheaper_between(picks, group, preset, at_least=0.5):
    """Estimated: the pick costs strictly less than the best fitting uniform
    candidate at `at_least` of the budgets `between` uniform points."""
    between = [r for r in picks if r["between"]]
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
    return _share(name, "time_s", at_least, between, gains)


@_check("pick", "best_uniform_measured_s")
def clock_faster_between(picks, group, preset, at_least=0.5):
    """By the clock: the pick is strictly faster than the fastest fitting
    uniform checkpoint at `at_least` of the budgets between uniform points."""
    between = [r for r in picks if r["clock_between"]]
    gains = [1 - r["clock_ratio"] for r in between if r["clock_ratio"] < 1.0]
    name = (
        f"measured: pick faster at >= {at_least:.0%} of the budgets "
        "between uniform points"
    )
    return _share(name, "step_s", at_least, between, gains)


def _raced(picks, ratios, at_most, value, rivals):
    """The pick against the fastest fitting of `rivals`, timed in the same
    interleaved rounds: `ratios`, its time over that one's per budget."""
    spread = max(r["spread"] for r in picks)
    name = f"measured: pick <= {at_most:.2f}x the fastest fitting {rivals}"
    measured = (
        f"{max(ratios):.3f}x at worst, {min(ratios):.3f}x at best "
        f"({len(picks)} budgets; spread up to {100 * spread:.1f}%)"
    )
    return _verdict(name, "step_s", at_most, value, measured)


@_check("pick", "best_uniform_measured_s")
def clock_pick_vs_uniform(picks, group, preset, at_most=1.03):
    """By the clock, every budget: the pick / the fastest fitting uniform."""
    ratios = [r["clock_ratio"] for r in picks]
    rivals = "uniform checkpoint (every budget)"
    return _raced(picks, ratios, at_most, max(ratios), rivals)


@_check("pick", "best_combination_s")
def clock_pick_vs_combinations(picks, group, preset, at_most=1.03):
    """Several stacks, by the clock, every budget: the pick / the fastest
    fitting combination of one uniform checkpoint per stack."""
    ratios = [r["combination_ratio"] for r in picks]
    rivals = "combination of uniform checkpoints per stack (every budget)"
    return _raced(picks, ratios, at_most, max(ratios), rivals)


@_check("pick", "best_same_s")
def clock_faster_than_same(picks, group, preset, at_least=0.5):
    """Several stacks, by the clock: the pick is strictly faster than the
    fastest fitting combination that puts one checkpoint on every stack at
    `at_least` of the budgets between those combinations' points."""
    between = [r for r in picks if r["same_between"]]
    gains = [1 - r["same_ratio"] for r in between if r["same_ratio"] < 1.0]
    name = (
        f"measured: pick faster than one checkpoint on every stack at >= "
        f"{at_least:.0%} of the budgets between their points"
    )
    v = _share(name, "step_s", at_least, between, gains)
    if not between:
        v["why"] = NOTHING_BETWEEN_SAME
    return v


@_check("pick")
def batch_pick_vs_combinations(picks, group, preset, at_most=1.03):
    """By the clock, every budget: the batch plan's pick fits, and its time /
    the fastest fitting (checkpoint x micro-batches x loss chunking)'s."""
    ratios = [r["ratio"] for r in picks]
    value = max(ratios) if all(r["fits"] for r in picks) else math.inf
    rivals = "(uniform checkpoint x micro-batches x loss chunking), every budget"
    return _raced(picks, ratios, at_most, value, rivals)


@_check("timed")
def rank_correlation(timed, group, preset, key="predicted_s", at_least=0.9):
    """Spearman's rank correlation of `key` (the planner's predicted time, or
    the roofline's) with the measured time, over every checkpoint timed."""
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
    return _verdict(name, "step_s", at_least, rho, measured, at_least=True)


@_check("pick", "plain_plan_s")
def batch_planning_cost(picks, group, preset, at_most=3.0):
    """Planning a batch / a checkpoint-only plan, both from an empty cache."""
    r = picks[0]
    x = r["plan_s"] / r["plain_plan_s"]
    name = f"planning a batch <= {at_most:.0f}x a checkpoint-only plan"
    measured = f"{x:.2f}x ({r['plan_s']:.0f} s vs {r['plain_plan_s']:.0f} s)"
    return _verdict(name, "seconds", at_most, x, measured)


# --------------------------------------------------------------------------------------
# The targets: (presets, check, its parameters); presets are a Preset type or names.

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
    (_models.Preset, clock_pick_vs_combinations),
    (_models.Preset, clock_faster_than_same),
)
BATCH_TARGETS = (
    (_models.Preset, batch_pick_vs_combinations),
    (_models.Preset, batch_planning_cost),
)


def evaluate(
    rows: Rows, presets: dict[str, _models.Preset], targets: Sequence = TARGETS
) -> list[Verdict]:
    """Every target of `targets` on every preset it applies to, in their order."""
    out = []
    for on, check, *params in targets:
        for name, preset in presets.items():
            if isinstance(preset, on) if isinstance(on, type) else name in on:
                out += check(rows, name, preset, *params)
    return out

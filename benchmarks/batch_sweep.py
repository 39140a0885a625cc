"""Fit a batch, by the clock: `eqx_remat.plan(..., micro_batches=...,
loss_chunks=...)` against every combination of a uniform checkpoint, a
micro-batch count and a loss chunking, compiled and timed on the device it runs
on; with `--target`, the pick compiled for TPU v5e beside MaxText's recipe. How
(budgets, races, one clock): benchmarks/README.md.

    python benchmarks/batch_sweep.py            # transformer-s and transformer-v
    python benchmarks/batch_sweep.py --preset transformer-s --budgets 3
    python benchmarks/batch_sweep.py --target v5e:2x4      # seed-llama, compiled
    python benchmarks/batch_sweep.py --quick               # transformer-tiny (tests)
"""

import argparse
import contextlib
import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

import eqx_remat as er
import zoo
from benchmarks import (
    _cli,
    _console,
    _ending,
    _format,
    _measure,
    _models,
    _plots,
    _results,
    _table,
    _targets,
    _timing,
)
from benchmarks._results import of_kind


UNIFORM = (None, "dots", "dots_no_batch", "nothing")
MICRO_BATCHES = (1, 2, 4)


def _parser() -> argparse.ArgumentParser:
    p = _cli.parser(__doc__, presets=list(_models.PRESETS), repeats=15)
    _cli.int_flag(p, "--budgets", 4, "how many budgets")
    return p


def _loss(model, tokens, axis=None):
    """The zoo's (chunked) loss; the flash kernel runs per chip under
    `jax.shard_map`, so there the batch axis of the vmap is the mesh's "data"."""
    losses = jax.vmap(model.loss, spmd_axis_name=axis)
    return losses(tokens[:, :-1], tokens[:, 1:]).mean()


GRAD = eqx.filter_grad(_loss)


@dataclasses.dataclass(frozen=True)
class _Combo:
    """One (checkpoint, micro-batches, loss chunk) combination, compiled:
    its compiled memory, and its time (`_time`, with the others)."""

    checkpoint: Any
    k: int
    chunk: int | None
    step: _timing.Step
    memory: int
    seconds: float = math.nan  # until timed

    @classmethod
    def compile(cls, model, tokens, checkpoint, k: int, chunk: int | None):
        model = zoo.set_loss_chunk_size(er.set_checkpoint(model, checkpoint), chunk)
        step = _timing.compile_step(er.accumulate(GRAD, k), model, tokens)
        return cls(checkpoint, k, chunk, step, step.memory_bytes)

    def name(self) -> str:
        return f"{self.checkpoint!r} x{self.k} chunk {self.chunk}"


def _time(combos: list[_Combo], rounds: int) -> list[er.internal.Timing]:
    """Timed together, on the first one's clock."""
    return _timing.time_steps([c.step for c in combos], rounds, on=0)


def _preset(name: str) -> _models.TransformerPreset:
    preset = _models.PRESETS[name]
    if not isinstance(preset, _models.TransformerPreset):
        _parser().error(
            f"--preset {name}: expected a zoo.Transformer preset "
            "(its loss head is what loss chunking splits)."
        )
    return preset


def sweep_preset(args, name: str, preset, console) -> list[dict[str, Any]]:
    """Every combination compiled and timed (a "combination" row each), then a
    "pick" row at each budget."""
    model, seq = preset.build(), preset.seq
    # `seq + 1` tokens per example: the loss predicts `seq` of them.
    shape = (preset.batch, seq + 1)
    tokens = jax.random.randint(jax.random.key(1), shape, 0, preset.vocab)
    chunks = (None, max(seq // 4, 1))
    counts = tuple(k for k in MICRO_BATCHES if tokens.shape[0] % k == 0)
    uniform = UNIFORM
    if args.checkpoint:
        uniform = [er.parse_checkpoint(c, preset.depth) for c in args.checkpoint]
    grid = list(itertools.product(uniform, counts, chunks))
    console.print(f"{name}: compiling {len(grid)} combinations")
    combos = [_Combo.compile(model, tokens, c, k, ch) for c, k, ch in grid]
    combos = [
        dataclasses.replace(c, seconds=t.seconds)
        for c, t in zip(combos, _time(combos, args.repeats), strict=True)
    ]
    low = min(c.memory for c in combos)
    high = combos[grid.index((None, 1, None))].memory
    budgets = np.geomspace(low, high, args.budgets).astype(int).tolist()
    rows = [
        {
            "group": name,
            "kind": "combination",
            "checkpoint": repr(c.checkpoint),
            "micro_batches": c.k,
            "loss_chunk_size": c.chunk,
            "memory_bytes": c.memory,
            "time_s": c.seconds,
            "tokens_per_s": tokens.shape[0] * seq / c.seconds,
        }
        for c in combos
    ]
    er.clear_plan_cache()
    for i, budget in enumerate(budgets):
        plain_s = _plain_plan(model, tokens, budget) if i == 0 else None
        way = (counts, chunks)
        rows.append(_pick(args, name, model, tokens, way, budget, combos, plain_s))
        console.print(_describe(rows[-1]))
    return rows


def _timed(f: Callable, *args, **kwargs) -> tuple[Any, float]:
    """`f(*args, **kwargs)` and the seconds it took."""
    start = time.perf_counter()
    return f(*args, **kwargs), time.perf_counter() - start


def _plain_plan(model, tokens, budget: int) -> float:
    """The seconds a checkpoint-only plan of `budget` takes, from an empty cache
    (and one that does not fit still costs them)."""
    er.clear_plan_cache()
    start = time.perf_counter()
    with contextlib.suppress(ValueError):
        er.plan(GRAD, model, tokens, budget_bytes=budget, progress=False)
    seconds = time.perf_counter() - start
    er.clear_plan_cache()
    return seconds


def _pick(args, name, model, tokens, way, budget, combos, plain_s) -> dict[str, Any]:
    """Plan at `budget`, then race the pick with the three fastest fitting
    combinations: a "pick" row (`plain_s`: a checkpoint-only plan's seconds)."""
    how = {"micro_batches": way[0], "loss_chunks": way[1], "progress": False}
    r, plan_s = _timed(er.plan, GRAD, model, tokens, budget_bytes=budget, **how)
    fitting = sorted((c for c in combos if c.memory <= budget), key=lambda c: c.seconds)
    pick = _Combo.compile(
        model, tokens, r.checkpoint, r.micro_batches, r.loss_chunk_size
    )
    timings = _time([pick, *fitting[:3]], args.repeats)
    rivals = timings[1:]
    best = min(range(len(rivals)), key=lambda i: rivals[i].seconds)
    ratio = er.internal.paired_ratio(timings[0], rivals[best])
    # On the clock of the combinations' rounds, as every other row: the
    # fastest rival's time there, times the pick's ratio to it here.
    seconds = fitting[best].seconds * ratio
    return {
        "group": name,
        "kind": "pick",
        "budget_bytes": budget,
        "checkpoint": str(r.checkpoint),
        "micro_batches": r.micro_batches,
        "loss_chunk_size": r.loss_chunk_size,
        "memory_bytes": pick.memory,
        "fits": pick.memory <= budget,
        "time_s": seconds,
        "tokens_per_s": tokens.shape[0] * (tokens.shape[1] - 1) / seconds,
        "best_combination": fitting[best].name(),
        "ratio": ratio,
        "spread": max(t.spread for t in timings),
        "plan_s": plan_s,
        "plain_plan_s": plain_s,
        "compiles": r.compiles,
    }


def _describe(row: dict[str, Any]) -> str:
    plain = row["plain_plan_s"]
    return (
        f"  {_format.fmt_bytes(row['budget_bytes'])}: {row['checkpoint']} "
        f"x{row['micro_batches']} chunk {row['loss_chunk_size']}, "
        f"{row['ratio']:.3f}x {row['best_combination']} "
        f"(spread {100 * row['spread']:.1f}%), planned in {row['plan_s']:.0f} s"
        + (f" (a checkpoint-only plan: {plain:.0f} s)" if plain else "")
    )


def aot_preset(args, name: str, preset, console) -> list[dict[str, Any]]:
    """Compiled for `--target`, nothing run, times by the roofline: the plan's
    pick for the preset's global batch at one chip's 16 GiB (an "aot-pick"
    row), beside MaxText's recipe, `"nothing"` at each per-chip batch that
    fits, doubling from 1 ("maxtext" rows)."""
    mesh = er.v5e_mesh(args.target)
    model = zoo.shard(preset.build(abstract=True), mesh, fsdp=preset.fsdp)
    axis = "data" if preset.attention == "flash" else None
    grad = eqx.filter_grad(functools.partial(_loss, axis=axis))

    def fn(model, tokens):  # gradients kept sharded like the parameters
        return zoo.shard(grad(model, tokens), mesh, fsdp=preset.fsdp)

    def plan(model, batch: int, **how) -> er.PlanResult:  # at 16 GiB per chip
        shape = jax.ShapeDtypeStruct((batch, preset.seq + 1), jax.numpy.int32)
        how |= {"budget_bytes": _measure.V5E_HBM, "target": args.target}
        tokens = _measure.place_batch(shape, mesh)
        return er.plan(fn, model, tokens, progress=False, **how)

    chips, tokens = mesh.size, preset.batch * preset.seq
    per_chip = preset.batch // chips
    counts = [k for k in (1, 2, 4) if per_chip % k == 0]
    with jax.set_mesh(mesh):
        console.print(f"{name}: planning micro-batches {counts} at 16 GiB per chip")
        how = {"micro_batches": counts, "loss_chunks": (None, 512)}
        r, plan_s = _timed(plan, model, preset.batch, **how)
        rows = [
            {
                "group": name,
                "kind": "aot-pick",
                "checkpoint": str(r.checkpoint),
                "micro_batches": r.micro_batches,
                "loss_chunk_size": r.loss_chunk_size,
                "per_chip_batch": per_chip,
                "memory_bytes": r.entry.memory_bytes,
                "time_s": r.entry.time_s,
                "tokens_per_s_per_chip": tokens / r.entry.time_s / chips,
                "plan_s": plan_s,
                "compiles": r.compiles,
            }
        ]
        nothing = er.set_checkpoint(model, "nothing")
        for b in (1, 2, 4, 8, 16, 32):
            console.print(f"{name}: MaxText's recipe, per-chip batch {b}")
            try:
                e = plan(nothing, b * chips, candidates=["nothing"]).entry
            except ValueError as err:
                if "fits" not in str(err):
                    raise
                break
            rows.append(
                {
                    "group": name,
                    "kind": "maxtext",
                    "checkpoint": "nothing",
                    "per_chip_batch": b,
                    "memory_bytes": e.memory_bytes,
                    "time_s": e.time_s,
                    "tokens_per_s_per_chip": b * preset.seq / e.time_s,
                }
            )
    estimate = er.internal.hardware(args.target)[0].estimate_note()
    for row in rows:
        console.print(
            f"  {row['kind']}: {row['checkpoint']} per-chip batch "
            f"{row['per_chip_batch']}, {_format.fmt_bytes(row['memory_bytes'])}, "
            f"{row['tokens_per_s_per_chip']:,.0f} tokens/s per chip ({estimate})"
        )
    return rows


# With --target, the pick is compiled beside MaxText's recipe for seed-llama.
RUN_ONLY = ("repeats", "checkpoint", "budgets", "quick")


def _names(args) -> list[str]:
    if args.preset:
        return args.preset
    if args.target or args.quick:
        return ["seed-llama" if args.target else "transformer-tiny"]
    return ["transformer-s", "transformer-v"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    def check(args) -> str | None:
        return _cli.presets_problem(args.checkpoint, _names(args))

    args = _cli.parse_args(
        _parser(), argv, "batch_sweep", check=check, run_only=RUN_ONLY
    )
    console = _console.Console()
    presets = {n: _preset(n) for n in _names(args)}
    t0 = time.perf_counter()
    each = aot_preset if args.target else sweep_preset
    rows = [r for n, p in presets.items() for r in each(args, n, p, console)]
    data = {
        "meta": _results.meta(args, seconds=time.perf_counter() - t0),
        "presets": {n: {"describe": p.describe()} for n, p in presets.items()},
        "rows": rows,
    }
    return _ending.finish(
        args,
        console,
        data,
        stem=_results.stem(args, quick=""),
        plot=plot,
        show=show,
        presets=presets,
        targets=_targets.BATCH_TARGETS,
    )


@dataclasses.dataclass(frozen=True)
class Pick:
    """One budget's pick (a row of kind "pick"), by the clock, beside the
    fastest fitting combination (the fields the table reads)."""

    group: str
    budget_bytes: int
    checkpoint: str
    micro_batches: int
    loss_chunk_size: int | None
    memory_bytes: int
    tokens_per_s: float
    ratio: float  # its time / the fastest fitting combination's
    best_combination: str
    plan_s: float
    plain_plan_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Compiled:
    """Compiled for a target (rows "aot-pick", the plan's, and "maxtext",
    MaxText's recipe at one per-chip batch): tokens/s per chip by the
    roofline."""

    group: str
    kind: str
    checkpoint: str
    per_chip_batch: int
    memory_bytes: int
    tokens_per_s_per_chip: float
    micro_batches: int = 1
    loss_chunk_size: int | None = None


def _plan_time(r: Pick) -> str:
    alone = f" ({r.plain_plan_s:.0f} s alone)" if r.plain_plan_s else ""
    return f"{r.plan_s:.0f} s{alone}"


C = _table.Column
PICKS: list[_table.Column[Pick]] = [
    C("preset", lambda r: r.group),
    C("budget", lambda r: _format.fmt_bytes(r.budget_bytes)),
    C("pick", lambda r: r.checkpoint, code=True),
    C("micro-batches", lambda r: r.micro_batches),
    C("loss chunk", lambda r: r.loss_chunk_size or "whole"),
    C("compiled", lambda r: _format.fmt_bytes(r.memory_bytes)),
    C("tokens/s", lambda r: f"{r.tokens_per_s:,.0f}"),
    C("vs fastest fitting", lambda r: f"{r.ratio:.3f}x"),
    C("which", lambda r: r.best_combination, code=True),
    C("planned in", _plan_time),
]
"""Each budget's pick, on the console and in report.py."""
COMPILED: list[_table.Column[Compiled]] = [
    C("preset", lambda r: r.group),
    C("what", lambda r: "plan" if r.kind == "aot-pick" else "MaxText's recipe"),
    C("checkpoint", lambda r: r.checkpoint, code=True),
    C("per-chip batch", lambda r: r.per_chip_batch),
    C("micro-batches", lambda r: r.micro_batches),
    C("loss chunk", lambda r: r.loss_chunk_size or "whole"),
    C("compiled", lambda r: _format.fmt_bytes(r.memory_bytes)),
    C(
        f"tokens/s per chip ({er.internal.HARDWARE['TPU v5 lite'].estimate_note()})",
        lambda r: f"{r.tokens_per_s_per_chip:,.0f}",
    ),
]
"""With --target: the plan's pick for the global batch beside MaxText's recipe
at each per-chip batch that fits, on the console and in report.py."""


def table(data: dict[str, Any]) -> tuple[list[_table.Column], list]:
    """The results' table: the picks, or compiled for a target."""
    if data["meta"].get("target"):
        return COMPILED, _table.read_all(Compiled, data["rows"])
    return PICKS, _table.read_all(Pick, of_kind(data["rows"], "pick"))


def show(console: _console.Console, data: dict[str, Any], where: str) -> None:
    _table.show(console, f"Batch planner [{where}]", *table(data))


def report(data: dict[str, Any]) -> str:
    """report.py's section: the presets, the table, the targets."""
    parts = [_table.presets_markdown(data), _table.markdown(*table(data))]
    return "\n\n".join([*parts, _table.targets_markdown(data)]).rstrip()


def plot(data: dict[str, Any], path: Path) -> None:
    """Tokens/s against the budget: the pick, and each uniform checkpoint at
    its best micro-batch count and loss chunking that fits; compiled for a
    target, tokens/s per chip against the per-chip batch."""
    if any(r["kind"] not in ("combination", "pick") for r in data["rows"]):
        return _plot_aot(data, path)
    groups = [g for g in data["presets"] if any(r["group"] == g for r in data["rows"])]
    fig, axes = _plots.plt().subplots(
        1, len(groups), figsize=(6.2 * len(groups), 5.2), squeeze=False
    )
    for ax, group in zip(axes[0], groups, strict=True):
        rows = [r for r in data["rows"] if r["group"] == group]
        picks, combos = of_kind(rows, "pick"), of_kind(rows, "combination")
        budgets = [r["budget_bytes"] / 2**20 for r in picks]
        ax.plot(budgets, [r["tokens_per_s"] for r in picks], "k-o", label="plan's pick")
        for c in dict.fromkeys(r["checkpoint"] for r in combos):
            mine = [r for r in combos if r["checkpoint"] == c]
            best = [
                max(
                    (r["tokens_per_s"] for r in mine if r["memory_bytes"] <= budget),
                    default=np.nan,
                )
                for budget in (p["budget_bytes"] for p in picks)
            ]
            ax.plot(budgets, best, "--.", label=f"{c}: its fastest combination")
        _plots.scale_for(ax, "x", budgets)
        ax.set(xlabel="memory budget (MiB)", ylabel="tokens/s, measured")
        _plots.panel_title(ax, group, data["presets"][group]["describe"])
        ax.grid(alpha=0.3)
        # Below the axes: a legend inside would hide points.
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2)
    _plots.suptitle(
        fig,
        "Batch planner: tokens/s of the plan's pick at each budget, beside each "
        "uniform checkpoint at its fastest micro-batch count and loss chunking "
        f"that fits\n{_plots.where_when(data['meta'])}",
    )
    _plots.save_figure(fig, path)


def _plot_aot(data: dict[str, Any], path: Path) -> None:
    """Tokens/s per chip (roofline): the pick beside MaxText's recipe at each
    per-chip batch that fits."""
    fig, ax = _plots.plt().subplots(figsize=(7, 5))
    maxtext = of_kind(data["rows"], "maxtext")
    xs = [r["per_chip_batch"] for r in maxtext]
    ys = [r["tokens_per_s_per_chip"] for r in maxtext]
    ax.plot(xs, ys, "--o", label="MaxText's recipe: 'nothing'")
    for r in of_kind(data["rows"], "aot-pick"):
        label = f"plan: x{r['micro_batches']} chunk {r['loss_chunk_size']}"
        xy = [r["per_chip_batch"]], [r["tokens_per_s_per_chip"]]
        ax.plot(*xy, "k*", markersize=12, label=label)
    _plots.scale_for(ax, "x", xs)
    ax.set(xlabel="per-chip batch", ylabel="tokens/s per chip (roofline)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=2)
    group, preset = next(iter(data["presets"].items()))
    _plots.suptitle(
        fig,
        f"Batch planner, {group}: the plan's pick beside MaxText's recipe, 16 GiB "
        f"per chip\n{preset['describe']}\n{_plots.where_when(data['meta'])}",
    )
    _plots.save_figure(fig, path)


if __name__ == "__main__":
    main()

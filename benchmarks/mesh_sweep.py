"""Choose the mesh, by hand: every split of the chips between data parallelism
and FSDP, each under a few checkpoints, compiled for its memory per chip, its
FLOPs and the bytes each chip sends in collectives, with the step time that the
roofline and the collectives estimate, under two stated models of overlap
(neither fitted): *serial* (the roofline's time plus the collectives') and
*overlapped* (the larger of the two). On the device at hand every option is run
too, and each model's ranking is held against the clock's (Spearman, medians
of interleaved rounds). Then `eqx_remat.plan(..., shard=...)` chooses the mesh
and the checkpoint itself: by the clock on the device at hand, ahead of time by
the serial model.

A mesh of `fsdp=k` is `("data", "fsdp")` of `chips / k` and `k` chips
(`eqx_remat.v5e_mesh(target, fsdp=k)` for a TPU v5e slice): the parameters
split over `"fsdp"` (`zoo.shard(model, mesh, fsdp=True, axis="fsdp")`), the
gradients kept so, the batch over both axes
(`zoo.shard_batch(tokens, mesh, axis=("data", "fsdp"))`). `fsdp=1` is data
parallelism, `fsdp=chips` FSDP over every chip (MaxText's default).

On the device at hand (this CPU: 8 host devices, set below where `XLA_FLAGS`
does not say) the estimate is one device's, as on a TPU: its share of the
roofline plus what it sends at the host's copy rate
(`eqx_remat.internal.hardware(None)`'s `interconnect_bytes_per_s`). The
devices share the host's cores and memory, so the clock sees every device's
work in turn: about 8 times one device's estimate, in the same order.

    python benchmarks/mesh_sweep.py                   # transformer-mesh, 8 devices
    python benchmarks/mesh_sweep.py --target v5e:2x4  # seed-llama, compiled
    python benchmarks/mesh_sweep.py --quick           # transformer-mesh-tiny (tests)
"""

import os


if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402

import eqx_remat as er  # noqa: E402
import zoo  # noqa: E402
from benchmarks import (  # noqa: E402
    _cli,
    _console,
    _ending,
    _format,
    _measure,
    _models,
    _results,
    _table,
    _targets,
    _timing,
)


AXES = ("data", "fsdp")
# What each target compares by default: its preset, and two checkpoints (on
# the seed setting `None` fits no chip; MaxText's default is "nothing").
DEFAULT = {None: "transformer-mesh", "v5e": "seed-llama"}
CHECKPOINTS = {None: ("None", "nothing"), "v5e": ("dots", "nothing")}


class Row(NamedTuple):
    preset: str
    target: str
    data: int
    fsdp: int
    checkpoint: str
    total_bytes: int | None
    fits: bool
    flops_per_chip: float | None
    roofline_s: float
    collective_bytes: int | None
    collective_s: float | None
    serial_s: float | None
    overlapped_s: float | None
    measured_s: float | None
    compile_s: float
    network_bytes: int | None = None  # of several slices: to the others


def _parser() -> argparse.ArgumentParser:
    return _cli.parser(__doc__, presets=list(_models.PRESETS), repeats=7)


def meshes(target: str | None) -> list[tuple[int, Any]]:
    """`(fsdp, mesh)` for every split of the chips, FSDP over all of them first."""
    return [(m.shape["fsdp"], m) for m in er.internal.mesh_splits(target)]


def step_fn(preset: _models.TransformerPreset, mesh: Any):
    """The gradient of the preset's loss, kept sharded like the parameters."""
    axis = AXES if preset.attention == "flash" else None

    def loss(model, tokens):
        logits = jax.vmap(model, spmd_axis_name=axis)(tokens)
        return _models.cross_entropy(logits, tokens)

    grad = eqx.filter_grad(loss)
    return lambda model, tokens: zoo.shard(
        grad(model, tokens), mesh, fsdp=True, axis="fsdp"
    )


def shard_for(preset: _models.TransformerPreset):
    """`plan`'s `shard=`: the preset's step and arguments on a mesh."""
    params, batch = preset.build(abstract=True), preset.inputs(abstract=True)

    def on(mesh):
        tokens = zoo.shard_batch(batch, mesh, axis=AXES)
        placed = zoo.shard(params, mesh, fsdp=True, axis="fsdp")
        return step_fn(preset, mesh), (placed, tokens)

    return on


def plan_free(name: str, preset: Any, target: str | None, rows: list[Row]) -> dict:
    """`plan` with the mesh free (`shard=`), at one chip's memory on a TPU
    target, else at the most any option of the grid needs (each fits): its
    pick, and how long it took."""
    budget = _measure.V5E_HBM if target else max(r.total_bytes or 0 for r in rows)
    on = shard_for(preset)
    fsdp, mesh = meshes(target)[0]  # FSDP over every chip (of a slice)
    fn, args = on(mesh)
    t0 = time.perf_counter()
    r = er.plan(fn, *args, budget_bytes=budget, target=target, shard=on)
    return {
        "preset": name,
        "budget_bytes": r.budget_bytes,
        "data": r.mesh.shape["data"],
        "fsdp": r.mesh.shape["fsdp"],
        "checkpoint": er.checkpoint_label(r.checkpoint),
        "memory_bytes": r.entry.memory_bytes,
        "time_s": r.entry.time_s,
        "measured": r.entry.measured,
        "compiles": r.compiles,
        "seconds": time.perf_counter() - t0,
        "notes": list(r.notes),
        # Ahead of time: the pick against FSDP over every chip of a slice, data
        # parallel across slices (MaxText's default mesh), under each
        # checkpoint of the grid, both estimated.
        "fsdp_all": [mesh.size // fsdp, fsdp],
        "vs_fsdp_all": {
            row.checkpoint: row.serial_s / r.entry.time_s
            for row in rows
            if target and row.fsdp == fsdp and row.fits and row.serial_s is not None
        },
    }


def measure(name: str, preset: Any, target: str | None, specs, repeats: int):
    """Every mesh under every checkpoint of `specs`: compiled, priced, and, on
    the device at hand, timed together."""
    hw = er.internal.hardware(target)[0]
    rows, steps, rooflines = [], [], {}
    on = shard_for(preset)
    for k, mesh in meshes(target):
        fn, (params, tokens) = on(mesh)
        # Arrays made once per mesh, in its placement, for every checkpoint.
        leaves = None if target else _timing.input_leaves(params, tokens)
        for spec in specs:
            c = er.parse_checkpoint(spec, preset.layers)
            model = er.set_checkpoint(params, c)
            t0 = time.perf_counter()
            with jax.set_mesh(mesh):
                if target:  # `memory_report` counts the FLOPs too
                    aot = _measure.compiled_aot(fn, (model, tokens), target)
                    refused = aot["total_bytes"] is None  # XLA: what it needs
                    total = aot["temp_bytes"] if refused else aot["total_bytes"]
                    sent, flops = aot["collective_bytes"], aot["flops"]
                    network = aot.get("network_bytes") or 0
                else:
                    count = er.count_flops(fn, model, tokens)
                    step = _timing.compile_step(fn, model, tokens, leaves=leaves)
                    report = step.report(int(count))
                    refused, total = False, report.total_bytes
                    sent, network = report.collective_bytes, report.network_bytes
                    flops = None if count.dynamic_loops else int(count)
                    steps.append(step)
                if spec not in rooflines:  # the same per chip on every mesh
                    rooflines[spec] = er.internal.roofline_seconds(
                        fn, model, tokens, target=target
                    )
                roofline = rooflines[spec]
            compile_s = time.perf_counter() - t0
            data = mesh.size // k
            print(f"  data {data} x fsdp {k}, {spec}: {compile_s:.0f} s", flush=True)
            comm = (
                None if sent is None else er.internal.collective_time(hw, sent, network)
            )
            per_chip = None if flops is None else flops / mesh.size
            rows.append(
                Row(
                    preset=name,
                    target=target or jax.default_backend(),
                    data=data,
                    fsdp=k,
                    checkpoint=er.checkpoint_label(c),
                    total_bytes=total,
                    fits=not refused and total <= (hw.capacity_bytes or math.inf),
                    flops_per_chip=per_chip,
                    roofline_s=roofline,
                    collective_bytes=sent,
                    collective_s=comm,
                    serial_s=None if comm is None else roofline + comm,
                    overlapped_s=None if comm is None else max(roofline, comm),
                    measured_s=None,
                    compile_s=compile_s,
                    network_bytes=network,
                )
            )
    if not target:
        timings = _timing.time_steps(steps, repeats, on="fastest")
        rows = [r._replace(measured_s=t.seconds) for r, t in zip(rows, timings)]
    return rows


def ranking(rows: list[Row]) -> dict[str, Any]:
    """Each model's Spearman against the clock, over the options timed."""
    timed = [r for r in rows if r.measured_s is not None]
    measured = [r.measured_s for r in timed]
    out = {}
    for model in ("roofline", "serial", "overlapped"):
        est = [getattr(r, f"{model}_s") for r in timed]
        ok = len(timed) > 2 and None not in est
        out[model] = _targets.spearman(est, measured) if ok else None
    return out


def main(argv: list[str] | None = None) -> dict:
    args = _cli.parse_args(
        _parser(),
        argv,
        "mesh_sweep",
        quick={"preset": ["transformer-mesh-tiny"], "repeats": 3},
    )
    target = args.target
    names = args.preset or [DEFAULT["v5e" if target else None]]
    specs = args.checkpoint or list(CHECKPOINTS["v5e" if target else None])
    console, t0 = _console.Console(), time.perf_counter()
    rows, plans = [], []
    # A per-chip batch (MaxText's `per_device_batch_size`) for every chip.
    chips = er.v5e_mesh(target).size if target else jax.device_count()
    presets = {n: _models.PRESETS[n].on(chips) for n in names}
    for name, preset in presets.items():
        console.print(f"[bold]{name}[/] ({preset.describe()}), {specs} ...")
        mine = measure(name, preset, target, specs, args.repeats)
        rows += mine
        console.print(f"[bold]{name}[/]: plan with the mesh free ...")
        plans.append(plan_free(name, preset, target, mine))
    data = {
        "meta": _results.meta(args, seconds=time.perf_counter() - t0, target=target),
        "presets": {n: {"describe": p.describe()} for n, p in presets.items()},
        "rows": [r._asdict() for r in rows],
        "spearman": ranking(rows),
        "plans": plans,
    }
    stem = "mesh_sweep" + ("_" + target.replace(":", "_") if target else "")
    stem += "_quick" * args.quick
    return _ending.finish(args, console, data, stem=stem, plot=None, show=show)


C = _table.Column


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g} s"


COLUMNS: list[_table.Column[Row]] = [
    C("preset", lambda r: r.preset),
    C("data x fsdp", lambda r: f"{r.data} x {r.fsdp}", "the mesh: chips per axis"),
    C("checkpoint", lambda r: r.checkpoint, code=True),
    C("memory/chip", lambda r: _format.fmt_bytes(r.total_bytes, 1), "compiled"),
    C("fits", lambda r: "yes" if r.fits else "no", "in one chip's memory"),
    C("roofline", lambda r: _s(r.roofline_s), "its step time, no collectives"),
    C(
        "sent/chip",
        lambda r: _format.fmt_bytes(r.collective_bytes, 1),
        "bytes one chip sends per step in collectives (compiled, loops counted)",
    ),
    C(
        "to other slices",
        lambda r: _format.fmt_bytes(r.network_bytes or None, 1),
        "of those, the bytes sent to chips of other slices (over the DCN)",
    ),
    C("collectives", lambda r: _s(r.collective_s), "their time (an estimate)"),
    C("serial", lambda r: _s(r.serial_s), "roofline + collectives"),
    C("overlapped", lambda r: _s(r.overlapped_s), "the larger of the two"),
    C("measured", lambda r: _s(r.measured_s), "median of interleaved rounds"),
]


def summary(data: dict) -> list[str]:
    """The plans with the mesh free and the rankings, a line each."""
    out = []
    for p in data["plans"]:
        how = "measured" if p["measured"] else "estimated"
        out.append(
            f"plan, the mesh free, {p['preset']} at "
            f"{_format.fmt_bytes(p['budget_bytes'], 1)}: data {p['data']} x fsdp "
            f"{p['fsdp']}, {p['checkpoint']}, {_format.fmt_bytes(p['memory_bytes'], 1)}"
            f", {_s(p['time_s'])} ({how}); {p['compiles']} compiles, "
            f"{p['seconds']:.0f} s"
            + "".join(
                f"; estimated {x:.3f}x as fast as data {d} x fsdp {f} with {c}"
                for d, f in [p.get("fsdp_all", (1, p["fsdp"] * p["data"]))]
                for c, x in p.get("vs_fsdp_all", {}).items()
            )
            + "".join(f"; note: {n}" for n in p["notes"][-1:])
        )
    rho = {m: x for m, x in data["spearman"].items() if x is not None}
    if rho:
        out.append(
            "Ranked against the clock (Spearman): "
            + ", ".join(f"{m} {x:.2f}" for m, x in rho.items())
            + "."
        )
    return out


def show(console: _console.Console, data: dict, where: str) -> None:
    rows = _table.read_all(Row, data["rows"])
    title = f"Meshes [{where}]"
    console.print(_table.legend(_table.show(console, title, COLUMNS, rows)))
    for n, p in data["presets"].items():
        console.print(f"  {n}: {p['describe']}")
    for line in summary(data):
        console.print(line)


def report(data: dict) -> str:
    """report.py's section: the presets, the table, the plans, the rankings."""
    rows = _table.read_all(Row, data["rows"])
    return "\n\n".join(
        [
            _table.presets_markdown(data),
            _table.markdown(COLUMNS, rows),
            *(f"- {line}" for line in summary(data)),
        ]
    )


if __name__ == "__main__":
    main()

"""How the benchmarks measure (benchmarks/README.md, "How we measure"): a
preset's variants compiled, timed round-robin here or each in its own process,
or compiled for TPU v5e ahead of time; one row each, which says so where the
variant does not fit.
"""

import argparse
import dataclasses
import functools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import eqx_remat as er
import zoo
from eqx_remat.internal import needed_bytes

from . import _console, _device, _format, _models, _peers, _timing


V5E_HBM = 16 * 2**30


@dataclasses.dataclass
class Variant:
    """One thing to measure: `build()` gives `(fn, args)`, typically
    `jax.value_and_grad` of a preset's loss and `(params, batch)`."""

    group: str  # the preset's name: ratios are taken within a group
    preset: _models.Preset
    impl: str  # "eqx_remat" or a peer's impl
    checkpoint: str
    schedule: str  # "None", "policy", "every", ... or "peer"
    build: Callable[[], tuple[Callable, tuple]]
    ours: tuple[str, ...] = ()  # a peer: the checkpoints of ours it is compared with

    def row(self, **fields: Any) -> dict[str, Any]:
        """Its row's first fields, then `fields`."""
        k = {"group": self.group, "impl": self.impl, "checkpoint": self.checkpoint}
        k |= {"compared_with": list(self.ours)} if self.ours else {}
        return k | {"schedule": self.schedule} | fields


def _kind(c: er.Checkpoint) -> str:
    return "None" if c is None else "policy" if isinstance(c, str) else type(c).__name__


def mesh_for(target: str | None) -> Any:
    """The TPU v5e mesh of `target`, else one axis over every device here."""
    if target:
        return er.v5e_mesh(target)
    return jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))


def place_batch(batch: Any, mesh: Any) -> Any:
    """`zoo.shard_batch`, or, where the devices do not divide the batch (a tiny
    batch on many chips), replicated with `zoo.shard`."""
    if batch.shape[0] % mesh.size:
        return zoo.shard(batch, mesh)
    return zoo.shard_batch(batch, mesh)


def variants(
    name: str,
    preset: _models.Preset,
    specs: Sequence[str],
    *,
    target: str | None = None,
    peers: bool = False,
    quick: bool = False,
) -> list[Variant]:
    """Ours under each checkpoint, then (`peers`) the preset's peers (`quick`:
    `_peers.of`'s few), on `mesh_for(target)` (parameters sharded as the preset
    says, the batch split)."""
    aot = target is not None

    @functools.cache  # one model and batch per preset, shared by its variants
    def placed() -> tuple[Any, Any]:
        mesh = mesh_for(target)
        model = zoo.shard(preset.build(abstract=aot), mesh, fsdp=preset.fsdp)
        return model, place_batch(preset.inputs(abstract=aot), mesh)

    def build(make: Callable[[Any], tuple[Callable, Any]]) -> Callable:
        def built():
            model, batch = placed()
            fn, params = make(model)
            return fn, (params, batch)

        return built

    out, seen = [], set()
    for spec in specs:
        c = er.parse_checkpoint(spec, preset.depth)
        label = er.checkpoint_label(c)
        if label not in seen:  # every(sqrt) is every(4) at depth 16
            seen.add(label)
            make = functools.partial(_models.ours, preset, checkpoint=c)
            out.append(Variant(name, preset, "eqx_remat", label, _kind(c), build(make)))
    for p in _peers.of(preset, quick=quick) if peers else ():
        make = functools.partial(p.make, preset)
        peer = Variant(name, preset, p.impl, p.checkpoint, "peer", build(make), p.ours)
        out.append(peer)
    return out


# --------------------------------------------------------------------------------------
# One variant: compile, memory, FLOPs.


def _flops(count: er.FlopCount) -> int | None:
    # Loops whose trip count is only known at run time are counted once: no number.
    return None if count.dynamic_loops else int(count)


def _report_fields(report: er.MemoryReport) -> dict[str, Any]:
    """A row's memory and FLOPs, from the library's report (the row names its
    own target)."""
    fields = {k: v for k, v in report.to_dict().items() if k != "target"}
    return fields | {"total_bytes": report.total_bytes, "flops": _flops(report.flops)}


def compile_variant(
    v: Variant, limit: int | None
) -> tuple[dict[str, Any], _timing.Step | None]:
    """`(row, step)`: compiled memory and FLOPs, and the step compiled
    (`_timing.compile_step`); `step` is `None` when the variant does not fit
    (the row says why)."""
    row = v.row(fits=True, device_kind=_device.device_kind())
    row |= {"device_count": jax.device_count(), "process_index": jax.process_index()}
    fn, args = v.build()
    try:
        step = _timing.compile_step(fn, *args)
    except jax.errors.JaxRuntimeError as e:  # XLA refuses what does not fit
        return {**row, "fits": False, "error": _format.first_line(e)}, None
    row["compile_s"] = step.compile_s
    row |= _report_fields(step.report(flops=er.count_flops(fn, *args)))
    if limit is not None and row["total_bytes"] > limit:
        row["fits"] = False
        row["error"] = f"compiled size {row['total_bytes']} B > limit {limit} B"
        return row, None
    return row, step


# --------------------------------------------------------------------------------------
# Many variants: in this process (round-robin), or one process each.


def measure_here(
    variants: Sequence[Variant],
    *,
    repeats: int,
    limit: int | None,
    step: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Compile and run every variant in this process; time them round-robin
    (`_timing.time_steps`): `step_s` the median of its rounds."""
    rows, ready = [], []
    for v in variants:
        step(f"compile {v.group} {v.impl} {v.checkpoint}")
        row, compiled = compile_variant(v, limit)
        rows.append(row)
        if compiled is None:
            continue
        try:  # one step, the warm-up: its loss
            first = jax.tree.leaves(jax.block_until_ready(compiled.run()))[0]
        except Exception as e:  # a run that fails (out of memory) marks the row
            row.update(fits=False, error=_format.first_line(e))
            continue
        row["loss"] = float(first) if first.ndim == 0 else None
        ready.append((row, compiled))
    timings = _timing.time_steps(
        [compiled for _, compiled in ready],
        repeats,
        warmup=False,  # the run above
        each_round=lambda r: step(f"time round {r + 1}/{repeats}"),
    )
    for t, (row, _) in zip(timings, ready, strict=True):
        row["step_s"], row["times_s"] = t.seconds, list(t.times)
        row["peak_bytes"] = _device.peak_bytes_in_use()  # None on the CPU
    return rows


def measure_isolated(
    variants: Sequence[Variant],
    *,
    argv: Sequence[str],
    step: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Each variant in a fresh process (the same script and flags, `--worker I`),
    so its measured peak memory is its own."""
    rows = []
    for i, v in enumerate(variants):
        step(f"run {v.group} {v.impl} {v.checkpoint} (own process)")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "row.json"
            cmd = [sys.executable, sys.argv[0], *argv, "--worker", str(i), str(path)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0 and path.exists():
                rows.append(json.loads(path.read_text()))
                continue
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        err = f"its process failed (rc {proc.returncode}): {tail}"
        rows.append(v.row(fits=False, error=err))
    return rows


def worker(args: Any, variants: Sequence[Variant]) -> dict:
    """`--worker I PATH`: measure variant I (peak memory, median step, and on a
    TPU v5e the AOT estimate for this topology) and write its row to PATH."""
    v = variants[int(args.worker[0])]
    (row,) = measure_here(
        [v], repeats=args.repeats, limit=args.memory_limit, step=lambda _: None
    )
    if row["fits"]:
        row |= aot_beside(v)
    Path(args.worker[1]).write_text(json.dumps(row))
    return {}


# --------------------------------------------------------------------------------------
# TPU v5e, ahead of time.


def compiled_aot(fn: Callable, args: tuple, target: str) -> dict[str, Any]:
    """`fn(*args)` compiled for `target` (`eqx_remat.memory_report`): per-chip
    memory, FLOPs, collectives, whether it fits a chip's memory (16 GiB of a
    v5e: XLA compiles programs a little over its 15.75 GiB limit, by this
    count). A program
    that does not fit a chip does not compile: XLA says how much memory it
    would need (`eqx_remat.internal.needed_bytes`), kept as `temp_bytes` with
    `fits: False` and `total_bytes: None`. The one compile of every script that
    compiles ahead of time."""
    try:
        report = er.memory_report(fn, *args, target=target)
    except jax.errors.JaxRuntimeError as e:
        need = needed_bytes(str(e))
        if need is None:
            raise
        flops = _flops(er.count_flops(fn, *args))
        return {"fits": False, "temp_bytes": need, "total_bytes": None} | {
            "flops": flops,
            "collective_bytes": None,
            "error": _format.first_line(e),
        }
    fields = _report_fields(report)
    hbm = er.internal.hardware(target)[0].memory_bytes
    return fields | {"fits": report.total_bytes <= hbm, "error": None}


def compile_aot(v: Variant, target: str) -> dict[str, Any]:
    """The row of `v` compiled for `target` (`compiled_aot`). `compile_s`
    includes counting the FLOPs, which `memory_report` does too."""
    fn, args = v.build()
    row = v.row(target=target, device_kind=er.internal.hardware(target)[0].kind)
    row["device_count"] = er.v5e_mesh(target).size
    t0 = time.perf_counter()
    row |= compiled_aot(fn, args, target)
    row["compile_s"] = time.perf_counter() - t0
    return row


# The v5e slice of each chip count (every slice v5e comes in).
_TOPOLOGY = {
    1: "1x1",
    4: "2x2",
    8: "2x4",
    16: "4x4",
    32: "4x8",
    64: "8x8",
    128: "8x16",
    256: "16x16",
}


def aot_beside(v: Variant) -> dict[str, Any]:
    """On a TPU v5e: the no-TPU estimate (`memory_report(target="v5e:AxB")` for
    this topology) beside the measured peak. Elsewhere: nothing."""
    if _device.device_kind() not in ("TPU v5 lite", "TPU v5e"):
        return {}
    if (shape := _TOPOLOGY.get(n := jax.device_count())) is None:
        return {"aot_target": None, "aot_error": f"no v5e slice has {n} chips"}
    target = f"v5e:{shape}"

    def build() -> tuple[Callable, Any]:  # inside the `try`: libtpu may fail
        fn, args = v.build()
        mesh = er.v5e_mesh(target)

        def abstract(x: Any) -> jax.ShapeDtypeStruct:  # the same sharding
            spec = getattr(getattr(x, "sharding", None), "spec", PartitionSpec())
            sharding = NamedSharding(mesh, spec)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        return fn, jax.tree.map(abstract, args)

    try:
        aot = compile_aot(dataclasses.replace(v, build=build), target)
    except Exception as e:
        return {"aot_target": target, "aot_error": _format.first_line(e)}
    return {"aot_target": target} | {
        f"aot_{k}": aot[k] for k in ("temp_bytes", "total_bytes")
    }


# --------------------------------------------------------------------------------------
# Ratios, device figures.


def add_figures(rows: list[dict[str, Any]], presets: dict[str, _models.Preset]) -> None:
    """Per row, against the `eqx_remat` `None` row of its group: `temp_ratio`,
    `flops_ratio`, `time_ratio`; and the device figures every row carries:
    `device_kind`, `peak_bytes`, `step_s`, throughput (`presets[group].per_step`),
    `mfu`, `hfu` (`None` where the backend cannot measure them)."""
    base = {
        r["group"]: r
        for r in rows
        if r["impl"] == "eqx_remat" and r["checkpoint"] == "None"
    }
    for r in rows:
        b = base.get(r["group"], {})
        for key, out in (
            ("temp_bytes", "temp_ratio"),
            ("flops", "flops_ratio"),
            ("step_s", "time_ratio"),
        ):
            ok = r.get(key) is not None and b.get(key)
            r[out] = r[key] / b[key] if ok else None
        r.setdefault("peak_bytes", None)
        r.setdefault("step_s", None)
        on = {"kind": r.get("device_kind"), "devices": r.get("device_count")}
        r["mfu"] = _device.utilisation(b.get("flops"), r["step_s"], **on)
        r["hfu"] = _device.utilisation(r.get("flops"), r["step_s"], **on)
        unit, n = presets[r["group"]].per_step()
        r[unit] = n / r["step_s"] if r["step_s"] else None


def steps(args: argparse.Namespace, variants: Sequence) -> int:
    """What `measure_all`'s progress bar counts: a compile per variant (or a
    process per variant, with `--isolate`), and where the variants are timed
    together, one step per round of them all."""
    together = not (args.target or args.deferred)
    return len(variants) + (args.repeats if together else 0)


def plan_of_work(args: argparse.Namespace, variants: Sequence, presets: int) -> str:
    """What the run is about to do, in the numbers its progress bar counts."""
    n = len(variants)
    if args.target:
        return f"{n} variants of {presets} presets, each compiled for {args.target}"
    if args.deferred:
        return f"{n} variants of {presets} presets, each run in a process of its own"
    return (
        f"{n} variants of {presets} presets: each compiled, then all timed "
        f"round-robin in {args.repeats} rounds ({steps(args, variants)} steps)"
    )


def measure_all(
    args: argparse.Namespace, variants: list, console: _console.Console
) -> list:
    """One row per variant (`run.py`'s and `seed_claim.py`'s): compiled for
    `--target`, or each in its own process (`--isolate`), or timed round-robin
    here; the progress bar counts `steps(args, variants)`."""
    with console.progress(steps(args, variants)) as step:
        if args.target:
            rows = []
            for v in variants:
                step(f"compile {v.group} {v.impl} {v.checkpoint}")
                rows.append(compile_aot(v, args.target))
            return rows
        if args.deferred:
            rows = measure_isolated(variants, argv=args.argv, step=step)
            _device.set_main(rows[0].get("process_index", 0) == 0)
            return rows
        return measure_here(
            variants, repeats=args.repeats, limit=args.memory_limit, step=step
        )

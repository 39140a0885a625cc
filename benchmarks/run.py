"""The policy / schedule sweep: memory, FLOPs and time of every checkpoint, against
peers, in one run.

For each preset (a zoo model and its size), one training step —
`jax.value_and_grad` of the loss, the model applied per example under `jax.vmap` —
is compiled under `checkpoint=None`, every policy and every schedule, beside the
same model written by hand with `lax.scan` + `jax.checkpoint`, in Flax linen with
`nn.scan(nn.remat(...))`, and (for the deep ResidualChain) with
`equinox.internal.scan(kind="checkpointed")` and a 2-level nested scan — same
architecture, same weights, so the losses agree. Reported: compiled temp memory,
FLOPs (`eqx_remat.count_flops`, recomputation included), compile time, and the
median step time after warm-up as a ratio to `None` measured in the same run.

    python benchmarks/run.py                      # CPU sweep (a few minutes)
    python benchmarks/run.py --quick              # tiny, end to end (tests)
    python benchmarks/run.py --preset transformer-m chain-m
    python benchmarks/run.py --target v5e         # per-chip memory, TPU v5e AOT
    python benchmarks/run.py --target v5e:2x4
    python benchmarks/run.py --target gpu         # on a machine with a GPU
    python benchmarks/run.py --budget 16GiB --target v5e   # the planner's table

Writes `results/sweep-<target>.{json,csv,png}` (`--budget`:
`results/plan-<target>.json`). On a TPU target nothing runs: memory comes from
the TPU compiler (libtpu, the `tpu` extra), and there are no timings.
"""

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path


def _platform(argv: list[str]) -> str:
    """`cuda` when `--target gpu` is asked for, else `cpu` (set before jax is
    imported; an explicit JAX_PLATFORMS wins)."""
    for i, a in enumerate(argv):
        if a == "--target=gpu" or (a == "--target" and argv[i + 1 : i + 2] == ["gpu"]):
            return "cuda"
    return "cpu"


os.environ.setdefault("JAX_PLATFORMS", _platform(sys.argv[1:]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _models as M  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402

import eqx_remat as er  # noqa: E402


CHECKPOINTS = {
    "transformer": (
        "None",
        "everything",
        "dots",
        "dots_no_batch",
        "nothing",
        "every(2)",
        "every(2, dots)",
        "nested(2)",
        "recursive()",
        "binomial(3)",
    ),
    "chain": (
        "None",
        "nothing",
        "every(sqrt)",
        "nested(2)",
        "nested(3)",
        "recursive()",
        "binomial(log2)",
    ),
    "mlp": (
        "None",
        "dots",
        "nothing",
        "every(sqrt)",
        "nested(2)",
        "recursive()",
        "binomial(log2)",
    ),
}
QUICK_CHECKPOINTS = {
    "transformer": ("None", "dots"),
    "chain": ("None", "recursive()", "binomial(log2)"),
    "mlp": ("None", "recursive()"),
}
QUICK_PEER_POLICIES = ("dots",)
# Offloading differs from saving only where there is a host memory (TPU, GPU).
OFFLOAD = ("offload_dots_no_batch",)
PEER_POLICIES = ("None", "everything", "dots", "dots_no_batch", "nothing")
V5E_PEER_POLICIES = ("None", "dots", "nothing")
V5E_CHECKPOINTS = {
    "transformer": (
        "None",
        "dots",
        "dots_no_batch",
        "nothing",
        "offload_dots_no_batch",
        "every(2)",
        "nested(2)",
        "recursive()",
    ),
}


def label(spec: str, depth: int) -> str:
    return C.checkpoint_label(C.parse_checkpoint(spec, depth))


def variants(name: str, preset, target: str, checkpoints, peers: bool, quick: bool):
    """The variants of one preset: ours under each checkpoint, then the peers."""
    aot = target.startswith("v5e")
    model = M.build(preset, abstract=aot)
    batch = M.batch(preset, abstract=aot)
    if aot:
        mesh = er.v5e_mesh(target)
        batch = C.batch_sharded(batch.shape, batch.dtype, mesh)
    loss = M.loss_fn(preset)
    out = []
    for spec in checkpoints:
        c = C.parse_checkpoint(spec, preset.depth)
        fn, params = M.ours(preset, model, c)
        flops = None
        if isinstance(c, er.binomial):
            # count_flops is an upper bound for binomial (it counts every branch
            # of the revolve actions); the planner counts its evaluations exactly.
            flops = _exact_flops(loss, model, batch, c)
        out.append(
            C.Variant(
                name, "eqx_remat", C.checkpoint_label(c), fn, (params, batch), flops
            )
        )
    if not peers:
        return out
    if preset.kind == "transformer":
        pols = (
            QUICK_PEER_POLICIES
            if quick
            else V5E_PEER_POLICIES
            if aot
            else PEER_POLICIES
        )
        for impl, make in (
            ("hand-written", M.handwritten_transformer),
            ("flax", M.flax_transformer),
        ):
            for spec in pols:
                fn, params = make(preset, model, C.parse_checkpoint(spec))
                out.append(C.Variant(name, impl, spec, fn, (params, batch)))
    elif preset.kind == "chain":
        log2 = label("binomial(log2)", preset.depth)[len("binomial(") : -1]
        outer, inner = M.nested_split(preset.depth)
        for impl, spec, (fn, params) in (
            ("hand-written", "None", M.plain_scan_chain(preset, model)),
            (
                "hand-written",
                f"nested-scan({outer}x{inner})",
                M.nested_scan_chain(preset, model),
            ),
            (
                "eqxi.scan",
                f"treeverse({log2})",
                M.treeverse_chain(preset, model, int(log2)),
            ),
        ):
            out.append(C.Variant(name, impl, spec, fn, (params, batch)))
    return out


def _exact_flops(loss, model, batch, c):
    def count():
        r = er.plan(
            eqx.filter_value_and_grad(loss),
            er.set_checkpoint(model, c),
            jax.ShapeDtypeStruct(batch.shape, batch.dtype),
            budget_bytes=2**62,
            candidates=[c],
        )
        return int(r.entry.flops)

    return count


# ---------------------------------------------------------------------------------
# Peer comparisons and targets.


def peer_pairs(rows):
    """For each peer row, the `eqx_remat` row it is compared with."""
    ours = {(r["group"], r["checkpoint"]): r for r in rows if r["impl"] == "eqx_remat"}
    pairs = []
    for p in rows:
        if p["impl"] == "eqx_remat":
            continue
        g, spec = p["group"], p["checkpoint"]
        if spec.startswith("treeverse("):
            k = spec[len("treeverse(") : -1]
            mine = [ours.get((g, "recursive()")), ours.get((g, f"binomial({k})"))]
        elif spec.startswith("nested-scan"):
            mine = [ours.get((g, "nested(2)"))]
        else:
            mine = [ours.get((g, spec))]
        pairs += [(o, p) for o in mine if o is not None]
    return pairs


def peer_rows(rows):
    out = []
    for o, p in peer_pairs(rows):
        r = {
            "group": o["group"],
            "ours": o["checkpoint"],
            "peer": f"{p['impl']} {p['checkpoint']}",
            "ours_temp_bytes": o["temp_bytes"],
            "peer_temp_bytes": p["temp_bytes"],
            "temp_ratio": _div(o["temp_bytes"], p["temp_bytes"]),
            "time_ratio": _div(o.get("median_s"), p.get("median_s")),
            "flops_ratio": _div(o.get("flops"), p.get("flops")),
        }
        if o.get("loss") is not None and p.get("loss") is not None:
            r["loss_ours"], r["loss_peer"] = o["loss"], p["loss"]
            r["loss_abs_diff"] = abs(o["loss"] - p["loss"])
            r["losses_equal"] = r["loss_abs_diff"] <= 1e-4 * max(1.0, abs(o["loss"]))
        out.append(r)
    return out


def _div(a, b):
    return a / b if a is not None and b else None


def _fmt_pct(x):
    return f"{100 * (1 - x):.0f}% less" if x <= 1 else f"{100 * (x - 1):.0f}% more"


def targets(rows, peers, presets, timed: bool):
    """DESIGN.md's targets, checked on this run's numbers."""
    out = []
    by = {(r["group"], r["impl"], r["checkpoint"]): r for r in rows}
    for name, preset in presets.items():
        if preset.kind == "transformer":
            base = by.get((name, "eqx_remat", "None"))
            for spec, limit in (("dots", 0.60), ("nothing", 0.30)):
                r = by.get((name, "eqx_remat", spec))
                if base and r and base["temp_bytes"]:
                    x = r["temp_bytes"] / base["temp_bytes"]
                    out.append(
                        C.Target(
                            f"{name}: {spec!r} temp <= {limit:.2f}x None",
                            x <= limit,
                            f"{x:.3f}x ({_fmt_pct(x)})",
                        )
                    )
            r = by.get((name, "eqx_remat", "dots"))
            if base and r and base["flops"]:
                x = r["flops"] / base["flops"]
                out.append(
                    C.Target(
                        f"{name}: 'dots' FLOPs <= 1.10x None", x <= 1.10, f"{x:.3f}x"
                    )
                )
            for impl, limit in (("hand-written", 1.02), ("flax", 1.00)):
                ps = [
                    p
                    for p in peers
                    if p["group"] == name
                    and p["peer"].startswith(impl)
                    and p["temp_ratio"] is not None
                ]
                if ps:
                    worst = max(ps, key=lambda p: p["temp_ratio"])
                    out.append(
                        C.Target(
                            f"{name}: temp <= {limit:.2f}x {impl} (every policy)",
                            worst["temp_ratio"] <= limit,
                            ", ".join(
                                f"{p['ours']} {p['temp_ratio']:.3f}x" for p in ps
                            ),
                        )
                    )
                    if timed and all(p["time_ratio"] is not None for p in ps):
                        worst = max(ps, key=lambda p: p["time_ratio"])
                        out.append(
                            C.Target(
                                f"{name}: step time <= 1.05x {impl} (every policy)",
                                worst["time_ratio"] <= 1.05,
                                ", ".join(
                                    f"{p['ours']} {p['time_ratio']:.2f}x" for p in ps
                                ),
                                "CPU timings on a shared 2-core machine are noisy",
                            )
                        )
        # Every schedule (and policy) below no checkpointing, under jax.vmap.
        base = by.get((name, "eqx_remat", "None"))
        ours = [
            r
            for r in rows
            if r["group"] == name
            and r["impl"] == "eqx_remat"
            and r["checkpoint"] not in ("None", "everything")
        ]
        if base and ours and base["temp_bytes"]:
            worst = max(ours, key=lambda r: r["temp_bytes"])
            x = worst["temp_bytes"] / base["temp_bytes"]
            out.append(
                C.Target(
                    f"{name}: under jax.vmap, every checkpoint <= None in temp",
                    x <= 1.0,
                    f"largest: {worst['checkpoint']} at {x:.3f}x None",
                )
            )
        if preset.kind == "chain":
            tv = [
                p
                for p in peers
                if p["group"] == name
                and "treeverse" in p["peer"]
                and p["temp_ratio"] is not None
            ]
            for p in tv:
                limit = 0.85 if p["ours"] == "recursive()" else 1.0
                mem_ok = p["temp_ratio"] <= limit
                time_ok = p["time_ratio"] is None or p["time_ratio"] < 1.0
                t = "" if p["time_ratio"] is None else f", time {p['time_ratio']:.2f}x"
                out.append(
                    C.Target(
                        f"{name} (D={preset.depth}): {p['ours']} temp <= {limit:.2f}x "
                        f"{p['peer']}" + (", and faster" if timed else ""),
                        mem_ok and time_ok,
                        f"temp {p['temp_ratio']:.3f}x{t}",
                    )
                )
    return out


# ---------------------------------------------------------------------------------
# Tables.


def sweep_table_rows(rows, timed: bool):
    out = []
    for r in rows:
        cells = [
            r["group"],
            r["impl"],
            r["checkpoint"],
            C.fmt_bytes(r["temp_bytes"]),
            C.fmt_ratio(r.get("temp_ratio")),
            C.fmt_flops(r.get("flops")),
            C.fmt_ratio(r.get("flops_ratio")),
            f"{r['compile_s']:.1f}",
        ]
        if timed:
            cells += [f"{1e3 * r['median_s']:.1f}", C.fmt_ratio(r.get("time_ratio"))]
        else:
            cells += [C.fmt_bytes(r.get("host_temp_bytes"))]
        cells.append("*" if r.get("pareto") else "")
        out.append(cells)
    return out


def sweep_columns(timed: bool):
    cols = ["preset", "impl", "checkpoint", "temp", "vs None", "FLOPs", "vs None"]
    cols += ["compile s"]
    cols += ["median ms", "vs None"] if timed else ["host temp"]
    return cols + ["Pareto"]


PEER_COLUMNS = ("preset", "ours", "peer", "temp ours/peer", "time ours/peer", "loss Δ")


def peer_table_rows(peers):
    return [
        (
            p["group"],
            p["ours"],
            p["peer"],
            C.fmt_ratio(p["temp_ratio"]),
            C.fmt_ratio(p["time_ratio"]),
            "-" if "loss_abs_diff" not in p else f"{p['loss_abs_diff']:.1e}",
        )
        for p in peers
    ]


def target_table_rows(ts):
    mark = {True: "met", False: "NOT met", None: "n/a"}
    return [(mark[t.met], t.name, t.measured, t.why) for t in ts]


# ---------------------------------------------------------------------------------


def plan_mode(args, presets, console) -> dict:
    """`--budget`: eqx_remat.plan's table for each preset."""
    target = None if args.target in ("cpu", "gpu") else args.target
    results = {"meta": C.meta(args.argv), "plans": []}
    for name, preset in presets.items():
        aot = target is not None
        model = M.build(preset, abstract=True)
        batch = M.batch(preset, abstract=True)
        if aot:
            batch = C.batch_sharded(batch.shape, batch.dtype, er.v5e_mesh(target))
        cands = None
        if args.checkpoints:
            cands = [C.parse_checkpoint(s, preset.depth) for s in args.checkpoints]
        console.print(f"[bold]{name}[/]: {preset.describe()} — planning ...")
        t0 = time.perf_counter()
        try:
            res = er.plan(
                eqx.filter_grad(M.loss_fn(preset)),
                model,
                batch,
                budget_bytes=args.budget,
                target=target,
                candidates=cands,
            )
        except ValueError as e:
            console.print(str(e), markup=False, highlight=False)
            results["plans"].append({"preset": name, "error": str(e)})
            continue
        console.print(str(res), markup=False, highlight=False)
        console.print(
            f"({len(res.table)} candidates in {time.perf_counter() - t0:.0f} s)"
        )
        results["plans"].append(
            {
                "preset": name,
                "describe": preset.describe(),
                "budget_bytes": res.budget_bytes,
                "target": res.target,
                "chosen": C.checkpoint_label(res.checkpoint),
                "table": [
                    {
                        "checkpoint": C.checkpoint_label(e.checkpoint),
                        "memory_bytes": e.memory_bytes,
                        "flops": e.flops,
                        "fits": e.fits,
                        **{f"report_{k}": v for k, v in e.report.to_dict().items()},
                    }
                    for e in res.table
                ],
            }
        )
    tag = (target or args.target).replace(":", "_")
    C.write_json(args.out / f"plan-{tag}.json", results)
    return results


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", nargs="+", default=None, choices=list(M.PRESETS))
    p.add_argument(
        "--target",
        default="cpu",
        help='"cpu" (default), "gpu", "v5e" (2x2, AOT) or "v5e:AxB"',
    )
    p.add_argument("--budget", default=None, help="plan for this budget, e.g. 16GiB")
    p.add_argument("--quick", action="store_true", help="tiny presets (tests)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per variant")
    p.add_argument("--checkpoints", nargs="+", default=None, help="override the list")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--out", type=Path, default=C.RESULTS)
    p.add_argument("--name", default=None, help="results file stem")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    console = C.console()

    aot = args.target.startswith("v5e")
    if args.target == "gpu":
        try:
            backend = jax.default_backend()
        except Exception as e:  # JAX_PLATFORMS=cuda without a GPU or jax[cuda]
            backend = f"none ({type(e).__name__}: {str(e)[:200]})"
        if backend != "gpu":
            p.error(
                f"--target gpu needs a GPU and jax[cuda12]; JAX backend: {backend}."
            )
    if args.target not in ("cpu", "gpu") and not aot:
        p.error(f"--target must be cpu, gpu, v5e or v5e:AxB. Got {args.target!r}.")
    names = args.preset or (
        M.QUICK_PRESETS if args.quick else M.V5E_PRESETS if aot else M.DEFAULT_PRESETS
    )
    presets = {n: M.PRESETS[n] for n in names}
    if args.budget:
        return plan_mode(args, presets, console)

    timed = not aot
    repeats = args.repeats or (2 if args.quick else 5)
    all_variants = []
    for name, preset in presets.items():
        specs = args.checkpoints or (
            QUICK_CHECKPOINTS[preset.kind]
            if args.quick
            else V5E_CHECKPOINTS.get(preset.kind, CHECKPOINTS[preset.kind])
            if aot
            else CHECKPOINTS[preset.kind] + (OFFLOAD if args.target == "gpu" else ())
        )
        if (
            preset.kind == "transformer"
            and aot
            and "offload_dots_no_batch" not in specs
        ):
            specs = specs + OFFLOAD
        all_variants += variants(
            name, preset, args.target, specs, not args.no_peers, args.quick
        )

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    t0 = time.perf_counter()
    with Progress(
        TextColumn("{task.description:<48}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as prog:
        task = prog.add_task("", total=len(all_variants) + (repeats if timed else 0))

        def progress(desc):
            prog.update(task, description=desc[:48])
            prog.advance(task)

        if aot:
            rows = []
            for v in all_variants:
                progress(f"compile {v.group} {v.impl} {v.checkpoint}")
                row = C.aot_measure(v.fn, v.args, args.target)
                if v.flops is not None:
                    row["flops"] = v.flops() if callable(v.flops) else v.flops
                rows.append(
                    {
                        "group": v.group,
                        "impl": v.impl,
                        "checkpoint": v.checkpoint,
                        **row,
                    }
                )
        else:
            rows = C.measure(all_variants, repeats=repeats, progress=progress)
    elapsed = time.perf_counter() - t0

    C.add_ratios(rows)
    C.mark_pareto(rows, "time_ratio" if timed else "flops_ratio")
    peers = peer_rows(rows)
    ts = targets(rows, peers, presets, timed)

    tag = args.name or (
        "sweep-" + args.target.replace(":", "_") + ("-quick" if args.quick else "")
    )
    results = {
        "meta": C.meta(args.argv, target=args.target, seconds=elapsed),
        "presets": {
            n: {"kind": pr.kind, "describe": pr.describe(), **dataclasses.asdict(pr)}
            for n, pr in presets.items()
        },
        "rows": rows,
        "peers": peers,
        "targets": [t.to_dict() for t in ts],
    }
    C.write_json(args.out / f"{tag}.json", results)
    C.write_csv(args.out / f"{tag}.csv", rows)
    where = "TPU v5e AOT, per chip" if aot else jax.devices()[0].device_kind
    C.plot_tradeoff(
        rows,
        args.out / f"{tag}.png",
        f"python benchmarks/run.py {' '.join(args.argv)} [{where}]",
    )

    for n, pr in presets.items():
        console.print(f"[bold]{n}[/]: {pr.describe()}")
    console.print(
        C.rich_table(
            f"Sweep [{where}]", sweep_columns(timed), sweep_table_rows(rows, timed)
        )
    )
    if peers:
        console.print(
            C.rich_table(
                "Against peers (same weights)", PEER_COLUMNS, peer_table_rows(peers)
            )
        )
    console.print(
        C.rich_table(
            "Targets", ("", "target", "measured", "note"), target_table_rows(ts)
        )
    )
    console.print(
        f"{len(rows)} variants in {elapsed:.0f} s; results in {args.out}/{tag}.*"
    )
    return results


if __name__ == "__main__":
    main()

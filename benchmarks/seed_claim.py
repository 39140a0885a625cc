"""The seed claim: how much memory `"dots"` saves on a large transformer, and
what it costs.

The claim under test: on TPU v5e, `checkpoint_dots` cuts peak activation memory
~40% at ~12% step-time cost for a transformer (bf16, batch 32, seq 2048, ~24
layers, ~3B parameters on a v5e-8 slice with the parameters sharded).

Without a TPU (the default on a CPU), each config of a small grid around that
point is compiled for TPU v5e with libtpu (the `tpu` extra) under each policy —
nothing runs — and reported per chip: XLA's temporary memory (for programs that
do not fit, XLA refuses to compile and says how much they would need: that is
reported), whether the whole fits in 16 GiB, and the FLOPs against `None`.

On a TPU or GPU (or with `--run`), the seed setting itself runs on the machine's
devices (FSDP over all of them, bf16): `None`, every policy and two schedules,
each in its own process — measured peak memory and step time as ratios to
`None`, each beside its AOT prediction on a TPU v5e. A variant that does not fit
is a row that says so.

    python benchmarks/seed_claim.py                  # AOT grid, no TPU (about an hour)
    python benchmarks/seed_claim.py --preset base 2x2
    python benchmarks/seed_claim.py --device tpu     # on a v5e-8: the real run
    python benchmarks/seed_claim.py --quick          # one tiny config (tests)

AOT rows are written after every compile; with `--out`/`--update-results` an
interrupted grid resumes where it stopped unless `--fresh`.
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path

from benchmarks import _common, _device, _measure, _models, _plots, _targets, run


# Each config: a preset (the seed setting, `_models.seed`, or one change to it)
# and the v5e topology it is compiled for.
GRID = {
    # The claim's config: v5e-8, batch 32, seq 2048.
    "base": (_models.seed(), "v5e:2x4"),
    "2x2": (_models.seed(), "v5e:2x2"),
    "d2560": (_models.seed(d_model=2560), "v5e:2x4"),
    "d3072-3B": (_models.seed(d_model=3072), "v5e:2x4"),
    "batch16": (_models.seed(batch=16), "v5e:2x4"),
    "seq1024": (_models.seed(seq=1024), "v5e:2x4"),
    "12layers": (_models.seed(layers=12), "v5e:2x4"),
    "replicated": (_models.seed(shard_params=False), "v5e:2x4"),
}
QUICK = {
    "tiny": (
        _models.seed(batch=8, d_model=256, layers=2, seq=256, vocab=512),
        "v5e:2x2",
    )
}
POLICIES = ("None", "dots", "nothing")
BASE_POLICIES = ("None", "dots", "dots_no_batch", "nothing", "offload_dots_no_batch")
REAL = ("None", "everything", "dots", "dots_no_batch", "nothing")
REAL += ("offload_dots_no_batch", "every(4, dots_no_batch)", "recursive()")


def _parser() -> argparse.ArgumentParser:
    p = _common.parser(__doc__, presets=list(GRID), target=False, runs=True)
    p.add_argument(
        "--run",
        action="store_true",
        help="run the seed setting on this machine's device, even a CPU "
        "(default: only on a TPU or GPU)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="do not resume the rows already in the output (default: off)",
    )
    return p


def _real(args: argparse.Namespace) -> bool:
    return args.run or _device.resolve_device(args.device) != "cpu"


def aot(args, grid, console) -> list[dict]:
    """Compile each config for its v5e topology; resume rows already written."""
    path = args.out / "seed_claim.json"
    old = (
        [] if args.fresh or not path.exists() else json.loads(path.read_text())["rows"]
    )
    rows = [r for r in old if "group" in r]
    done = {(r["group"], r["checkpoint"]) for r in rows}
    for name, (preset, topology) in grid.items():
        specs = args.checkpoint or (BASE_POLICIES if name == "base" else POLICIES)
        specs = [s for s in specs if (name, s) not in done]
        vs = _measure.variants(
            name, preset, specs, target=topology, peers=False, quick=False
        )
        for v in vs:
            console.print(
                f"[bold]{name}[/] ({preset.describe()}, {topology}): {v.checkpoint} ..."
            )
            rows.append(_measure.compile_aot(v, topology))
            console.print(
                f"    temp {_common.fmt_bytes(rows[-1]['temp_bytes'])}/chip, "
                f"fits: {rows[-1]['fits']}"
            )
            if _common.is_main():
                _common.write_json(path, {"rows": rows})
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = _common.parse_args(_parser(), argv, "seed_claim", defer=_common.isolate)
    args.target = None
    console = _common.Console()
    grid = QUICK if args.quick else GRID
    if args.preset:
        grid = {n: grid[n] for n in args.preset if n in grid}
    t0 = time.perf_counter()
    if _real(args):
        name = "base" if "base" in grid else next(iter(grid))
        preset = grid[name][0]
        variants = _measure.variants(
            name, preset, args.checkpoint or REAL, target=None, peers=False, quick=False
        )
        if args.worker:
            return _measure.worker(args, variants)
        rows, presets = run.measure(args, variants, console), {name: preset}
    else:
        rows, presets = aot(args, grid, console), {n: p for n, (p, _) in grid.items()}
    _measure.add_figures(rows)
    _measure.add_throughput(rows, presets)
    data = {
        "meta": _common.meta(
            args,
            rows[0],
            seconds=time.perf_counter() - t0,
            # The AOT grid compiles each config for its own v5e slice.
            **({} if _real(args) else {"target": "v5e (each config's slice)"}),
        ),
        "claim": __doc__.split("\n\n")[1],
        "presets": {
            n: {
                "describe": p.describe(),
                "topology": "this machine" if _real(args) else grid[n][1],
                **dataclasses.asdict(p),
            }
            for n, p in presets.items()
        },
        "rows": rows,
        "targets": _targets.evaluate(rows, presets),
    }
    stem = "seed_claim" + "_quick" * args.quick + "_run" * _real(args)
    path = _common.write(args, stem, data, plot)
    show(console, data, _real(args))
    console.print(f"results in {path}")
    return data


def show(console: _common.Console, data: dict, real: bool) -> None:
    where = (
        f"{data['meta']['device']}, run"
        if real
        else "TPU v5e per chip, compiled, not run"
    )
    cols = ["config", "checkpoint", "temp/chip", "total/chip", "fits", "temp/None"]
    cols += ["FLOPs/None"]
    cols += ["peak", "AOT total", "time/None", "MFU"] if real else []
    out = []
    for r in data["rows"]:
        cells = [
            r["group"],
            r["checkpoint"],
            _common.fmt_bytes(r.get("temp_bytes")),
            _common.fmt_bytes(r.get("total_bytes")),
            "yes" if r["fits"] else "no (XLA refuses)" if r.get("error") else "no",
            _common.fmt_ratio(r.get("temp_ratio")),
            _common.fmt_ratio(r.get("flops_ratio")),
        ]
        if real:
            cells += [
                _common.fmt_bytes(r.get("peak_bytes")),
                _common.fmt_bytes(r.get("aot_total_bytes")),
                _common.fmt_ratio(r.get("time_ratio")),
                _common.fmt_pct(r.get("mfu")),
            ]
        out.append(cells)
    console.table(f"Seed claim [{where}]", cols, out, left=2)
    for n, p in data["presets"].items():
        console.print(f"  {n}: {p['describe']}, {p['topology']}")
    _common.show_targets(console, data["targets"])


def plot(data: dict, path: Path) -> None:
    """Per config and checkpoint: temp memory per chip, on a linear axis; hatched
    where it does not fit (for a program XLA refused to compile, the memory it
    says the program needs)."""
    from matplotlib.patches import Patch

    pyplot = _common.plt()
    rows = [r for r in data["rows"] if r.get("temp_bytes") is not None]
    configs = list(dict.fromkeys(r["group"] for r in rows))
    specs = list(dict.fromkeys(r["checkpoint"] for r in rows))
    colours = {s: f"C{i}" for i, s in enumerate(specs)}
    fig, ax = pyplot.subplots(figsize=(11, 5))
    width = 0.8 / max(1, len(specs))
    for j, s in enumerate(specs):
        pts = [(configs.index(r["group"]), r) for r in rows if r["checkpoint"] == s]
        bars = ax.bar(
            [i + j * width for i, _ in pts],
            [r["temp_bytes"] / _common.GiB for _, r in pts],
            width,
            color=colours[s],
            edgecolor="white",
            linewidth=0.5,
        )
        for b, (_, r) in zip(bars, pts):
            if not r["fits"]:
                b.set_hatch("///")
    ax.axhline(16, color="k", ls="--", lw=1)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))], configs)
    ax.set_ylabel("temp memory per chip (GiB)")
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    handles = [Patch(color=colours[s], label=s) for s in specs] + [
        Patch(facecolor="white", edgecolor="0.3", hatch="///", label="does not fit"),
        pyplot.Line2D([], [], color="k", ls="--", lw=1, label="16 GiB, one v5e chip"),
    ]
    ax.legend(handles=handles, fontsize=8.5, ncols=2)
    meta = data["meta"]
    how = "compiled for TPU v5e (not run)" if meta.get("target") else meta["device"]
    first, preset = next(iter(data["presets"].items()))
    others = "; each other config changes one thing" if len(configs) > 1 else ""
    _plots.suptitle(
        fig,
        f"Per-chip temp memory of a zoo.Transformer training step, {how}, per "
        f"configuration and checkpoint\n{first}: {preset['describe']}, "
        f"{preset['topology']}{others}. Programs XLA refused: the memory it says "
        f"they need. jax {meta['versions']['jax']}, {meta['date']}",
    )
    _common.save_figure(fig, path)


if __name__ == "__main__":
    main()

"""The seed claim: how much memory `"dots"` saves on a large transformer, and
what it costs.

The claim under test: on TPU v5e, `checkpoint_dots` cuts peak activation memory
~40% at ~12% step-time cost for a transformer (bf16, batch 32, seq 2048, ~24
layers, ~3B parameters on a v5e-8 slice with the parameters sharded).

Without a TPU, a grid of configs around it is compiled for TPU v5e (libtpu) and
nothing runs; on a TPU or GPU (or with `--run`) the seed setting runs, one
process per variant. AOT rows are written after every compile: an interrupted
grid resumes unless `--fresh`.

    python benchmarks/seed_claim.py                  # AOT grid, no TPU (about an hour)
    python benchmarks/seed_claim.py --preset base 2x2
    python benchmarks/seed_claim.py --device tpu     # on a v5e-8: the real run
    python benchmarks/seed_claim.py --quick          # one tiny config (tests)
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
    "base": (_models.seed(), "v5e:2x4"),  # the claim's config
    "2x2": (_models.seed(), "v5e:2x2"),
    "d2560": (_models.seed(d_model=2560), "v5e:2x4"),
    "d3072-3B": (_models.seed(d_model=3072), "v5e:2x4"),
    "batch16": (_models.seed(batch=16), "v5e:2x4"),
    "seq1024": (_models.seed(seq=1024), "v5e:2x4"),
    "12layers": (_models.seed(layers=12), "v5e:2x4"),
    "replicated": (_models.seed(shard_params=False), "v5e:2x4"),
}
TINY = _models.seed(batch=8, d_model=256, layers=2, seq=256, vocab=512)
QUICK = {"tiny": (TINY, "v5e:2x2")}
POLICIES = ("None", "dots", "nothing")
BASE_POLICIES = ("None", "dots", "dots_no_batch", "nothing", "offload_dots_no_batch")
REAL = ("None", "everything", "dots", "dots_no_batch", "nothing")
REAL += ("offload_dots_no_batch", "every(4, dots_no_batch)", "recursive()")


def _fits(r: dict) -> str:
    return "yes" if r["fits"] else "no (XLA refuses)" if r.get("error") else "no"


COLUMNS = {  # the table's header: a row's cell
    "config": lambda r: r["group"],
    "checkpoint": lambda r: r["checkpoint"],
    "temp/chip": lambda r: _common.fmt_bytes(r.get("temp_bytes")),
    "total/chip": lambda r: _common.fmt_bytes(r.get("total_bytes")),
    "fits": _fits,
    "temp/None": lambda r: _common.fmt_ratio(r.get("temp_ratio")),
    "FLOPs/None": lambda r: _common.fmt_ratio(r.get("flops_ratio")),
}
RUN_COLUMNS = {  # after those, for a real run
    "peak": lambda r: _common.fmt_bytes(r.get("peak_bytes")),
    "AOT total": lambda r: _common.fmt_bytes(r.get("aot_total_bytes")),
    "time/None": lambda r: _common.fmt_ratio(r.get("time_ratio")),
    "MFU": lambda r: _common.fmt_pct(r.get("mfu")),
}


def _parser() -> argparse.ArgumentParser:
    p = _common.parser(__doc__, presets=list(GRID), target=False, runs=True)
    p.add_argument(
        "--run",
        action="store_true",
        help="run the seed setting (or each --preset) on this machine's device, "
        "even a CPU (default: only on a TPU or GPU)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="do not resume the rows already in the output (default: off)",
    )
    return p


def aot(args: argparse.Namespace, grid: dict, console: _common.Console) -> list[dict]:
    """Compile each config for its v5e topology, writing the rows after each
    compile; resume the rows already written unless `--fresh`."""
    path = args.out / "seed_claim.json"
    fresh = args.fresh or not path.exists()
    rows = [] if fresh else json.loads(path.read_text())["rows"]
    rows = [r for r in rows if "group" in r]
    done = {(r["group"], r["checkpoint"]) for r in rows}
    for name, (preset, topology) in grid.items():
        specs = args.checkpoint or (BASE_POLICIES if name == "base" else POLICIES)
        specs = [s for s in specs if (name, s) not in done]
        for v in _measure.variants(name, preset, specs, target=topology):
            what = f"{name} ({preset.describe()}, {topology}): {v.checkpoint}"
            console.print(f"[bold]{what}[/] ...")
            rows.append(_measure.compile_aot(v, topology))
            temp = _common.fmt_bytes(rows[-1]["temp_bytes"])
            console.print(f"    temp {temp}/chip, fits: {rows[-1]['fits']}")
            if _common.is_main():
                _common.write_json(path, {"rows": rows})
    return rows


def _real(args: argparse.Namespace) -> bool:
    return args.run or _device.resolve_device(args.device) != "cpu"


def _grid(args: argparse.Namespace) -> dict:
    """The presets given; else the grid, or for a real run the seed setting."""
    grid = QUICK if args.quick else GRID
    return {n: grid[n] for n in args.preset or list(grid)[: 1 if _real(args) else None]}


def _problem(args: argparse.Namespace) -> str | None:
    if args.quick and args.preset:
        return (
            f"argument --preset: --quick measures its own grid, which holds only "
            f"{', '.join(QUICK)}: leave out --preset or --quick."
        )
    depths = {f"--preset {n}": p.depth for n, (p, _) in _grid(args).items()}
    return _common.depth_problem(args.checkpoint, depths)


def main(argv: list[str] | None = None) -> dict:
    args = _common.parse_args(
        _parser(),
        argv,
        "seed_claim",
        defer=_common.isolate,
        check=_problem,
        compiles_only=lambda a: None if _real(a) else "without --run (AOT for v5e)",
    )
    args.target = None
    real, grid = _real(args), _grid(args)
    console, t0 = _common.Console(), time.perf_counter()
    presets = {n: preset for n, (preset, _) in grid.items()}
    if real:
        specs = args.checkpoint or REAL
        variants = [
            v for n, p in presets.items() for v in _measure.variants(n, p, specs)
        ]
        if args.worker:
            return _measure.worker(args, variants)
        rows = run.measure(args, variants, console)
    else:
        rows = aot(args, grid, console)
    _measure.add_figures(rows, presets)
    # The AOT grid compiles each config for its own v5e slice.
    where = {} if real else {"target": "v5e (each config's slice)"}
    data = {
        "meta": _common.meta(args, rows[0], seconds=time.perf_counter() - t0, **where),
        "claim": __doc__.split("\n\n")[1],
        "presets": {
            n: {
                "describe": p.describe(),
                "topology": "this machine" if real else grid[n][1],
                **dataclasses.asdict(p),
            }
            for n, p in presets.items()
        },
        "rows": rows,
        "targets": _targets.evaluate(rows, presets),
    }
    stem = "seed_claim" + "_quick" * args.quick + "_run" * real
    path = _common.write(args, stem, data, plot)
    show(console, data, real)
    console.print(f"results in {path}")
    return data


def show(console: _common.Console, data: dict, real: bool) -> None:
    where = "TPU v5e per chip, compiled, not run"
    where = f"{data['meta']['device']}, run" if real else where
    columns = COLUMNS | (RUN_COLUMNS if real else {})
    rows = [[cell(r) for cell in columns.values()] for r in data["rows"]]
    console.table(f"Seed claim [{where}]", list(columns), rows, left=2)
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
    fig, ax = pyplot.subplots(figsize=(11, 5))
    width = 0.8 / max(1, len(specs))
    for j, s in enumerate(specs):
        mine = [r for r in rows if r["checkpoint"] == s]
        bars = ax.bar(
            [configs.index(r["group"]) + j * width for r in mine],
            [r["temp_bytes"] / _common.GiB for r in mine],
            width,
            color=f"C{j}",
            edgecolor="white",
            linewidth=0.5,
        )
        for b, r in zip(bars, mine):
            b.set_hatch("" if r["fits"] else "///")
    line = ax.axhline(16, color="k", ls="--", lw=1, label="16 GiB, one v5e chip")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))], configs)
    ax.set(ylabel="temp memory per chip (GiB)", ylim=(0, None))
    ax.grid(axis="y", alpha=0.3)
    handles = [Patch(color=f"C{j}", label=s) for j, s in enumerate(specs)]
    hatched = Patch(
        facecolor="white", edgecolor="0.3", hatch="///", label="does not fit"
    )
    ax.legend(handles=[*handles, hatched, line], fontsize=8.5, ncols=2)
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

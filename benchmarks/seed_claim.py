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
import time
from pathlib import Path
from typing import NamedTuple

from benchmarks import (
    _cli,
    _console,
    _device,
    _ending,
    _format,
    _measure,
    _models,
    _plots,
    _results,
    _table,
    _targets,
)


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


@dataclasses.dataclass(frozen=True)
class Row:
    """One config compiled (or run) under one checkpoint (the fields the
    tables and the plot read)."""

    group: str  # the config
    checkpoint: str
    fits: bool
    temp_bytes: int | None = None  # a refused program: what XLA says it needs
    total_bytes: int | None = None  # temp + arguments + outputs, per chip
    temp_ratio: float | None = None
    flops_ratio: float | None = None
    peak_bytes: int | None = None
    aot_total_bytes: int | None = None
    time_ratio: float | None = None
    mfu: float | None = None
    error: str | None = None

    def per_chip(self) -> int | None:
        """What the plot draws against one chip's memory: temp + arguments +
        outputs where it compiled, XLA's figure for what it needs where not."""
        return self.total_bytes or self.temp_bytes


def _fits(r: Row) -> str:
    return "yes" if r.fits else "no (XLA refuses)" if r.error else "no"


C = _table.Column
COLUMNS: list[_table.Column[Row]] = [
    C("config", lambda r: r.group),
    C("checkpoint", lambda r: r.checkpoint, code=True),
    C("temp/chip", lambda r: _format.fmt_bytes(r.temp_bytes)),
    C("total/chip", lambda r: _format.fmt_bytes(r.total_bytes)),
    C("fits", _fits),
    C("temp/None", lambda r: _format.fmt_ratio(r.temp_ratio)),
    C("FLOPs/None", lambda r: _format.fmt_ratio(r.flops_ratio)),
    C("peak", lambda r: _format.fmt_bytes(r.peak_bytes)),
    C("AOT total", lambda r: _format.fmt_bytes(r.aot_total_bytes)),
    C("time/None", lambda r: _format.fmt_ratio(r.time_ratio)),
    C("MFU", lambda r: _format.fmt_pct(r.mfu)),
]
"""The seed claim's columns, on the console and in report.py (those `n/a` in
every row, a real run's without one, left out)."""


def _parser() -> argparse.ArgumentParser:
    p = _cli.parser(__doc__, presets=list(GRID), target=False, runs=True)
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


def aot(args: argparse.Namespace, grid: dict, console: _console.Console) -> list[dict]:
    """Compile each config for its v5e topology, writing the rows after each
    compile; resume the rows already written unless `--fresh`."""
    path = args.out / "seed_claim.json"
    fresh = args.fresh or not path.exists()
    rows = [] if fresh else _results.read(path)["rows"]
    rows = [r for r in rows if "group" in r]
    done = {(r["group"], r["checkpoint"]) for r in rows}
    for name, (preset, topology) in grid.items():
        specs = args.checkpoint or (BASE_POLICIES if name == "base" else POLICIES)
        specs = [s for s in specs if (name, s) not in done]
        for v in _measure.variants(name, preset, specs, target=topology):
            what = f"{name} ({preset.describe()}, {topology}): {v.checkpoint}"
            console.print(f"[bold]{what}[/] ...")
            rows.append(_measure.compile_aot(v, topology))
            temp = _format.fmt_bytes(rows[-1]["temp_bytes"])
            console.print(f"    temp {temp}/chip, fits: {rows[-1]['fits']}")
            if _device.is_main():
                _results.write_json(path, {"rows": rows})
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
    return _cli.depth_problem(args.checkpoint, depths)


def main(argv: list[str] | None = None) -> dict:
    args = _cli.parse_args(
        _parser(),
        argv,
        "seed_claim",
        defer=_cli.isolate,
        check=_problem,
        compiles_only=lambda a: None if _real(a) else "without --run (AOT for v5e)",
    )
    args.target = None
    real, grid = _real(args), _grid(args)
    console, t0 = _console.Console(), time.perf_counter()
    presets = {n: preset for n, (preset, _) in grid.items()}
    if real:
        specs = args.checkpoint or REAL
        variants = [
            v for n, p in presets.items() for v in _measure.variants(n, p, specs)
        ]
        if args.worker:
            return _measure.worker(args, variants)
        rows = _measure.measure_all(args, variants, console)
    else:
        rows = aot(args, grid, console)
    _measure.add_figures(rows, presets)
    # The AOT grid compiles each config for its own v5e slice.
    where = {} if real else {"target": "v5e (each config's slice)"}
    data = {
        "meta": _results.meta(args, rows[0], seconds=time.perf_counter() - t0, **where),
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
    return _ending.finish(
        args,
        console,
        data,
        stem="seed_claim" + "_quick" * args.quick + "_run" * real,
        plot=plot,
        show=show,
    )


def show(console: _console.Console, data: dict, where: str) -> None:
    """The table, then each config (`where` is said by the results: the grid
    is compiled for each config's own slice)."""
    meta = data["meta"]
    aot = "TPU v5e per chip, compiled, not run"
    where = aot if meta.get("target") else f"{meta['device']}, run"
    rows = _table.read_all(Row, data["rows"])
    _table.show(console, f"Seed claim [{where}]", COLUMNS, rows)
    for n, p in data["presets"].items():
        console.print(f"  {n}: {p['describe']}, {p['topology']}")


def report(data: dict) -> str:
    """report.py's section: the configs, the table, the targets."""
    rows = _table.read_all(Row, data["rows"])
    presets = _table.presets_markdown(data, topology=True)
    return "\n\n".join(
        [presets, _table.markdown(COLUMNS, rows), _table.targets_markdown(data)]
    )


HBM_GIB = 16  # one v5e chip's memory: the plot's line


class Bar(NamedTuple):
    config: str
    checkpoint: str
    gib: float  # `Row.per_chip`, in GiB
    fits: bool


def bars(data: dict) -> list[Bar]:
    """The bars of `plot`, from the results: per config and checkpoint, the
    memory per chip that XLA's verdict (`fits`) is about, so a bar is hatched
    (does not fit) exactly where it stands above one chip's 16 GiB."""
    rows = _table.read_all(Row, data["rows"])
    return [
        Bar(r.group, r.checkpoint, r.per_chip() / _format.GiB, r.fits)
        for r in rows
        if r.per_chip()
    ]


def _change(name: str, preset: dict, base: dict) -> str:
    """What a config changes from the first (the seed setting), for its tick."""
    if preset is base:
        return f"the seed setting\n{preset['topology']}"
    said = {"shard_params": lambda v: "params " + ("sharded" if v else "replicated")}
    said["topology"] = lambda v: f"{v} slice"
    changed = [
        said.get(k, lambda v, k=k: f"{k} {v}")(v)
        for k, v in preset.items()
        if k != "describe" and base.get(k) != v
    ]
    return "\n".join(changed) or name


def plot(data: dict, path: Path) -> None:
    """Per config and checkpoint: memory per chip (temp + arguments + outputs;
    for a program XLA refused, what it says it needs) on a linear axis, against
    one chip's 16 GiB; hatched where it does not fit."""
    from matplotlib.patches import Patch

    pyplot = _plots.plt()
    drawn = bars(data)
    configs = list(dict.fromkeys(b.config for b in drawn))
    specs = list(dict.fromkeys(b.checkpoint for b in drawn))
    fig, ax = pyplot.subplots(figsize=(11, 5.6))
    width = 0.8 / max(1, len(specs))
    for j, s in enumerate(specs):
        mine = [b for b in drawn if b.checkpoint == s]
        patches = ax.bar(
            [configs.index(b.config) + j * width for b in mine],
            [b.gib for b in mine],
            width,
            color=f"C{j}",
            edgecolor="white",
            linewidth=0.5,
        )
        for p, b in zip(patches, mine):
            p.set_hatch("" if b.fits else "///")
    line = ax.axhline(HBM_GIB, color="k", ls="--", lw=1, label="16 GiB, one v5e chip")
    presets = data["presets"]
    base = next(iter(presets.values()))
    ticks = [f"{c}\n{_change(c, presets[c], base)}" for c in configs]
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))], ticks)
    ax.tick_params(axis="x", labelsize=8)
    ax.set(
        xlabel="configuration: the seed setting, then one change to it each",
        ylabel="memory per chip (GiB)",
        ylim=(0, None),
    )
    ax.grid(axis="y", alpha=0.3)
    handles = [Patch(color=f"C{j}", label=s) for j, s in enumerate(specs)]
    hatched = Patch(
        facecolor="white", edgecolor="0.3", hatch="///", label="does not fit"
    )
    ax.legend(handles=[*handles, hatched, line], fontsize=8.5, ncols=2)
    meta = data["meta"]
    how = "compiled for TPU v5e, not run" if meta.get("target") else meta["device"]
    first = next(iter(presets))
    _plots.suptitle(
        fig,
        f"Seed claim: memory per chip of a zoo.Transformer training step ({how}), "
        f"per configuration and checkpoint\n{first}: {base['describe']}. Memory: "
        "temp + arguments + outputs; for a program XLA refused, what it says it "
        f"needs. jax {meta['versions']['jax']}, {meta['date']}",
    )
    _plots.save_figure(fig, path)


if __name__ == "__main__":
    main()

"""The seed claim, reproduced on TPU v5e ahead of time: how much memory `"dots"`
saves on a large transformer, per chip, and what it costs in FLOPs.

The claim under test: on TPU v5e, `checkpoint_dots` cuts peak activation memory
~40% at ~12% step-time cost for a transformer (bf16, batch 32, seq 2048, ~24
layers, ~3B parameters on a v5e-8 slice with the parameters sharded).

For each config of a small grid around that point, one training gradient of
`zoo.Transformer` (bf16 compute, float32 parameters, vocab 32000, head dim 128,
plain attention, per-example model vmapped over the batch) is compiled for TPU v5e
with libtpu — no TPU needed — under each policy, with the batch split over the
chips and (`fsdp`) every parameter sharded over them too. Reported per chip:
XLA's temporary memory (for programs that do not fit, XLA refuses to compile and
says how much they would need: that number is reported), arguments + outputs,
whether the whole fits in a chip's 16 GiB, the reduction of temp memory against
`None`, and the FLOPs of the step (`eqx_remat.count_flops`, recomputation
included) against `None`. The step-time half of the claim needs a TPU.

    python benchmarks/seed_claim.py                  # the grid (about an hour)
    python benchmarks/seed_claim.py --configs base 2x2
    python benchmarks/seed_claim.py --quick          # one tiny config (test)

Results are written after every compile to `results/seed_claim.json` (and
`.csv`, `.png`); an interrupted run resumes where it stopped unless `--fresh`.
Needs the `tpu` extra (libtpu).
"""

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path


os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _models as M  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import eqx_remat as er  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int
    layers: int
    seq: int
    batch: int
    topology: str
    fsdp: bool = True
    vocab: int = 32000

    @property
    def params(self) -> int:
        """The number of parameters of the model."""
        model = M.build(self.preset(), abstract=True)
        leaves = jax.tree.leaves(eqx.filter(model, M.is_arraylike))
        return sum(math.prod(x.shape) for x in leaves)

    def preset(self) -> M.TransformerPreset:
        heads = max(1, self.d_model // 128)  # head dim 128
        return M.TransformerPreset(
            self.vocab,
            self.seq,
            self.d_model,
            heads,
            self.layers,
            self.batch,
            "bfloat16",
        )

    def describe(self) -> str:
        return (
            f"d_model {self.d_model}, {self.layers} layers, seq {self.seq}, "
            f"batch {self.batch}, {self.topology}, "
            f"{'FSDP' if self.fsdp else 'replicated'} params "
            f"({self.params / 1e9:.3g}B parameters)"
        )


BASE = Config(2048, 24, 2048, 32, "v5e:2x4")
GRID = {
    "base": BASE,  # the claim's config: v5e-8, batch 32, seq 2048, 24 layers
    "2x2": dataclasses.replace(BASE, topology="v5e:2x2"),
    "d2560": dataclasses.replace(BASE, d_model=2560),
    "d3072-3B": dataclasses.replace(BASE, d_model=3072),
    "batch16": dataclasses.replace(BASE, batch=16),
    "seq1024": dataclasses.replace(BASE, seq=1024),
    "12layers": dataclasses.replace(BASE, layers=12),
    "replicated": dataclasses.replace(BASE, fsdp=False),
}
QUICK = {"tiny": Config(256, 2, 256, 8, "v5e:2x2", vocab=512)}
POLICIES = {
    "base": ("None", "dots", "dots_no_batch", "nothing", "offload_dots_no_batch")
}
DEFAULT_POLICIES = ("None", "dots", "nothing")


def step(config: Config, checkpoint):
    """`(grad_fn, model, tokens)` with abstract, sharded arrays."""
    preset = config.preset()
    mesh = er.v5e_mesh(config.topology)
    model = M.build(preset, checkpoint, abstract=True)
    place = C.fsdp if config.fsdp else C.replicated
    params, static = eqx.partition(model, M.is_arraylike)
    params = place(params, mesh)
    tokens = C.batch_sharded((config.batch, config.seq), jnp.int32, mesh)
    loss = M.loss_fn(preset)
    return jax.grad(lambda p, t: loss(eqx.combine(p, static), t)), params, tokens


def run(names, grid, policies_for, out: Path, fresh: bool, console) -> dict:
    data = {"meta": C.meta(), "claim": __doc__.split("\n\n")[1], "rows": []}
    if out.exists() and not fresh:
        old = json.loads(out.read_text())
        data["rows"] = old.get("rows", [])
    done = {(r["config"], r["checkpoint"]) for r in data["rows"]}
    for name in names:
        config = grid[name]
        for spec in policies_for(name):
            if (name, spec) in done:
                continue
            console.print(f"[bold]{name}[/] ({config.describe()}): {spec} ...")
            fn, params, tokens = step(config, C.parse_checkpoint(spec))
            row = C.aot_measure(fn, (params, tokens), config.topology)
            row = {
                "config": name,
                "checkpoint": spec,
                **dataclasses.asdict(config),
                "param_count": config.params,
                **row,
            }
            verdict = "fits" if row["fits_16GiB"] else "does NOT fit"
            console.print(
                f"    temp {C.fmt_bytes(row['temp_bytes'])}/chip, total "
                f"{C.fmt_bytes(row['total_bytes'])}/chip: {verdict} "
                f"({row['compile_s']:.0f} s)"
            )
            data["rows"].append(row)
            summarise(data)
            C.write_json(out, data)
    summarise(data)
    C.write_json(out, data)
    return data


def summarise(data: dict) -> None:
    rows = data["rows"]
    base = {r["config"]: r for r in rows if r["checkpoint"] == "None"}
    for r in rows:
        b = base.get(r["config"])
        r["temp_reduction_vs_None"] = (
            1 - r["temp_bytes"] / b["temp_bytes"] if b and b["temp_bytes"] else None
        )
        r["flops_overhead_vs_None"] = (
            r["flops"] / b["flops"] - 1 if b and b.get("flops") else None
        )


def table_rows(data: dict):
    out = []
    for r in data["rows"]:
        red = r.get("temp_reduction_vs_None")
        fl = r.get("flops_overhead_vs_None")
        out.append(
            (
                r["config"],
                r["checkpoint"],
                C.fmt_bytes(r["temp_bytes"])
                + ("" if r["compiled"] else " (XLA: need)"),
                C.fmt_bytes(r["total_bytes"]) if r["compiled"] else "-",
                "yes" if r["fits_16GiB"] else "no",
                "-" if red is None else f"{100 * red:.0f}%",
                "-" if fl is None else f"{100 * fl:+.1f}%",
                C.fmt_bytes(r["host_temp_bytes"]) if r["host_temp_bytes"] else "-",
            )
        )
    return out


COLUMNS = (
    "config",
    "checkpoint",
    "temp/chip",
    "temp+args+out/chip",
    "fits 16 GiB",
    "temp vs None",
    "FLOPs vs None",
    "host temp",
)


def plot(data: dict, path: Path) -> None:
    pyplot = C.plt()
    rows = data["rows"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    specs = list(dict.fromkeys(r["checkpoint"] for r in rows))
    fig, ax = pyplot.subplots(
        figsize=(max(6, 1.4 * len(configs) * len(specs) / 3), 4.5)
    )
    width = 0.8 / max(1, len(specs))
    for j, s in enumerate(specs):
        xs, ys, hatches = [], [], []
        for i, c in enumerate(configs):
            r = next(
                (r for r in rows if r["config"] == c and r["checkpoint"] == s), None
            )
            if r is None:
                continue
            xs.append(i + j * width)
            ys.append(r["temp_bytes"] / C.GiB)
            hatches.append(not r["fits_16GiB"])
        bars = ax.bar(xs, ys, width, label=s)
        for b, h in zip(bars, hatches):
            if h:
                b.set_hatch("//")
    ax.axhline(16, color="k", ls="--", lw=1, label="16 GiB (one v5e chip)")
    ax.set_yscale("log")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))], configs)
    ax.set_ylabel("temp memory per chip (GiB, log)")
    ax.set_title(
        "zoo.Transformer gradient on TPU v5e (AOT): per-chip temp memory; "
        "hatched = does not fit",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=None, choices=list(GRID))
    p.add_argument("--policies", nargs="+", default=None)
    p.add_argument("--quick", action="store_true", help="one tiny config (tests)")
    p.add_argument("--out", type=Path, default=C.RESULTS)
    p.add_argument("--fresh", action="store_true", help="do not resume")
    args = p.parse_args(argv)
    grid = QUICK if args.quick else GRID
    names = list(grid) if args.configs is None or args.quick else args.configs

    def policies_for(name):
        if args.policies:
            return args.policies
        return POLICIES.get(name, DEFAULT_POLICIES)

    console = C.console()
    stem = "seed_claim_quick" if args.quick else "seed_claim"
    data = run(
        names, grid, policies_for, args.out / f"{stem}.json", args.fresh, console
    )
    data["meta"] = C.meta(argv)
    C.write_json(args.out / f"{stem}.json", data)
    C.write_csv(args.out / f"{stem}.csv", data["rows"])
    plot(data, args.out / f"{stem}.png")
    console.print(
        C.rich_table("Seed claim on TPU v5e (AOT)", COLUMNS, table_rows(data))
    )
    for name in dict.fromkeys(r["config"] for r in data["rows"]):
        console.print(f"  {name}: {grid.get(name, GRID.get(name)).describe()}")
    return data


if __name__ == "__main__":
    main()

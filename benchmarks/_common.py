"""The measurement code shared by the benchmark scripts.

How we measure (DESIGN.md): memory is the compiled program's
`memory_analysis()` (deterministic; per chip on TPU v5e, compiled ahead of time);
FLOPs are `eqx_remat.count_flops` (loop trip counts and recomputation included);
time is the median of repeated steps after warm-up, reported as a ratio to a
baseline measured in the same run. Steps of all variants are timed round-robin
(one step of each, repeated), so that a noisy neighbour slows every variant alike.

Nothing here is part of the `eqx_remat` API: the benchmarks use `eqx_remat` and
`zoo` through their public names only.
"""

import csv
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_remat as er  # noqa: E402


RESULTS = Path(__file__).resolve().parent / "results"
GiB = 2**30
MiB = 2**20
V5E_HBM = 16 * GiB


# --------------------------------------------------------------------------------------
# Checkpoint specs as strings (CLI, JSON, CSV) and back.


def parse_checkpoint(spec: str, depth: int | None = None) -> er.Checkpoint:
    """`"None"`, a policy name, or a schedule written as Python:
    `"every(4)"`, `"every(sqrt)"` (k = round(√depth)), `"nested(2, 'dots')"`,
    `"recursive()"`, `"binomial(10)"`, `"binomial(log2)"` (slots = ⌈log₂ depth⌉)."""
    spec = spec.strip()
    if spec in ("None", "none", ""):
        return None
    if spec in er.POLICIES:
        return spec
    match = re.fullmatch(r"(every|nested|recursive|binomial)\((.*)\)", spec)
    if match is None:
        raise ValueError(
            f"Unknown checkpoint {spec!r}. It needs to be one of None, "
            f"{', '.join(er.POLICIES)}, every(k), nested(levels), recursive(), "
            "binomial(slots)."
        )
    fn, inner = match.groups()
    args: list[Any] = []
    for part in [p.strip() for p in inner.split(",") if p.strip()]:
        if part == "sqrt":
            args.append(max(1, round(math.sqrt(_need(depth, spec)))))
        elif part == "log2":
            args.append(max(1, math.ceil(math.log2(max(2, _need(depth, spec))))))
        elif part.strip("'\"") in er.POLICIES:
            args.append(part.strip("'\""))
        else:
            args.append(int(part))
    return getattr(er, fn)(*args)


def _need(depth: int | None, spec: str) -> int:
    if depth is None:
        raise ValueError(f"{spec!r} needs the depth of the stack.")
    return depth


def checkpoint_label(c: er.Checkpoint) -> str:
    """A short, stable label: `None`, `dots`, `every(32)`, `nested(2)`,
    `recursive()`, `binomial(10)`, `every(4, dots)`."""
    if c is None:
        return "None"
    if isinstance(c, str):
        return c
    if isinstance(c, er.Schedule):
        fields = [f.name for f in dataclasses.fields(c)]
        values = [getattr(c, f) for f in fields]
        parts = [str(v) for f, v in zip(fields, values) if f != "policy"]
        if getattr(c, "policy", None) is not None:
            parts.append(str(c.policy))
        return f"{type(c).__name__}({', '.join(parts)})"
    return repr(c)


# --------------------------------------------------------------------------------------
# Machine, command, versions.


def meta(argv: Sequence[str] | None = None, **extra: Any) -> dict[str, Any]:
    """What ran, where, with what: stored at the top of every results file."""

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    dev = jax.devices()[0]
    argv = sys.argv[1:] if argv is None else list(argv)
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "?"
    return {
        "command": " ".join(["python", f"benchmarks/{script}", *argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "versions": {
            n: version(n)
            for n in ("jax", "jaxlib", "equinox", "flax", "libtpu", "eqx-remat")
        },
        **extra,
    }


# --------------------------------------------------------------------------------------
# Compile, measure memory, time.


@dataclasses.dataclass
class Variant:
    """One thing to measure: a function of `args` (typically
    `jax.value_and_grad(loss)` of a model's arrays and a batch).

    `group` is what ratios are taken within (a preset); `impl` is whose
    implementation it is (`"eqx_remat"`, `"hand-written"`, `"flax"`, ...);
    `checkpoint` is the label of the checkpoint it uses. `flops` (a number, or a
    function computing it) may be given when `count_flops` of `fn` is not the
    number to report (e.g. an exact count)."""

    group: str
    impl: str
    checkpoint: str
    fn: Callable[..., Any]
    args: tuple
    flops: int | Callable[[], int] | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


def compile_fn(fn: Callable[..., Any], args: tuple) -> tuple[Any, float]:
    """`jax.jit(fn).lower(*args).compile()` and the seconds it took (trace, lower
    and compile)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def memory_of(compiled: Any) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {
        "temp_bytes": int(m.temp_size_in_bytes),
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "host_temp_bytes": int(getattr(m, "host_temp_size_in_bytes", 0)),
    }


def _first_scalar(out: Any) -> float | None:
    leaves = jax.tree.leaves(out)
    if leaves and jnp.ndim(leaves[0]) == 0:
        return float(leaves[0])
    return None


def measure(
    variants: Sequence[Variant],
    *,
    repeats: int = 5,
    timed: bool = True,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Compile and (if `timed`) run every variant on the local backend.

    Returns one row per variant: memory (`temp_bytes`, ...), `flops`,
    `compile_s`, `loss` (the first scalar the function returns) and `median_s`
    (the median of `repeats` steps after one warm-up step, all variants timed
    round-robin). `progress`, if given, is called with a short description before
    each compile and each timing round."""
    rows, compiled = [], []
    for v in variants:
        if progress:
            progress(f"compile {v.group} {v.impl} {v.checkpoint}")
        c, secs = compile_fn(v.fn, v.args)
        if v.flops is None:
            flops = er.count_flops(v.fn, *v.args)
            # Loops whose trip count is only known at run time (while loops)
            # are counted once: the count would be meaningless.
            flops = None if flops.dynamic_loops else int(flops)
        else:
            flops = v.flops() if callable(v.flops) else v.flops
        row = {
            "group": v.group,
            "impl": v.impl,
            "checkpoint": v.checkpoint,
            **memory_of(c),
            "flops": flops,
            "compile_s": secs,
            **v.info,
        }
        if timed:
            out = jax.block_until_ready(c(*v.args))  # warm-up
            row["loss"] = _first_scalar(out)
            del out
        rows.append(row)
        compiled.append(c)
    if timed:
        times: list[list[float]] = [[] for _ in variants]
        for r in range(repeats):
            if progress:
                progress(f"time round {r + 1}/{repeats}")
            for i, (v, c) in enumerate(zip(variants, compiled)):
                t0 = time.perf_counter()
                jax.block_until_ready(c(*v.args))
                times[i].append(time.perf_counter() - t0)
        for row, ts in zip(rows, times):
            row["median_s"] = statistics.median(ts)
            row["times_s"] = ts
    return rows


_XLA_NEED = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)")
_XLA_HAVE = re.compile(r"exceeds available HBM \(([\d.]+)([KMGT]?)\)")
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def aot_measure(
    fn: Callable[..., Any], args: tuple, target: str, *, count: bool = True
) -> dict[str, Any]:
    """Per-chip memory of `fn(*args)` compiled for `target` (`"v5e"`,
    `"v5e:2x4"`) with `eqx_remat.memory_report`; args may be
    `jax.ShapeDtypeStruct`s with `NamedSharding`s on `eqx_remat.v5e_mesh(target)`.

    Programs that do not fit in a chip do not compile: XLA says how much temporary
    memory they would need, and that is reported as `temp_bytes` (rounded to
    XLA's two decimals) with `compiled: False`."""
    t0 = time.perf_counter()
    try:
        r = er.memory_report(fn, *args, target=target)
    except jax.errors.JaxRuntimeError as e:
        need, have = _XLA_NEED.search(str(e)), _XLA_HAVE.search(str(e))
        if need is None:
            raise
        row: dict[str, Any] = {
            "compiled": False,
            "temp_bytes": int(float(need.group(1)) * _UNIT[need.group(2)]),
            "argument_bytes": None,
            "output_bytes": None,
            "host_temp_bytes": None,
            "xla_available_bytes": have
            and int(float(have.group(1)) * _UNIT[have.group(2)]),
            "flops": int(er.count_flops(fn, *args)) if count else None,
            "target": target,
        }
    else:
        row = {"compiled": True, **r.to_dict()}
        row["compile_s"] = time.perf_counter() - t0
        if count:
            # Loops with run-time trip counts are counted once: no number.
            f = er.count_flops(fn, *args)
            row["flops"] = None if f.dynamic_loops else int(f)
    row.setdefault("compile_s", time.perf_counter() - t0)
    total = sum(row[k] or 0 for k in ("temp_bytes", "argument_bytes", "output_bytes"))
    row["total_bytes"] = total
    row["fits_16GiB"] = bool(row["compiled"] and total <= V5E_HBM)
    return row


def fsdp(tree: Any, mesh: Any) -> Any:
    """`ShapeDtypeStruct`s of `tree`'s arrays, each sharded over the mesh's one
    axis along its largest dimension divisible by the mesh size (FSDP / ZeRO-3
    style: every chip holds 1/n of every parameter); other arrays replicated."""
    n = mesh.size

    def place(x):
        if not eqx.is_array(x) and not isinstance(x, jax.ShapeDtypeStruct):
            return x
        spec: list[Any] = [None] * len(x.shape)
        axes = [i for i in range(len(x.shape)) if x.shape[i] % n == 0 and i > 0]
        if axes and len(x.shape) >= 2:
            spec[max(axes, key=lambda i: (x.shape[i], i))] = "data"
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, P(*spec))
        )

    return jax.tree.map(place, tree)


def replicated(tree: Any, mesh: Any) -> Any:
    def place(x):
        if not eqx.is_array(x) and not isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))

    return jax.tree.map(place, tree)


def batch_sharded(shape: tuple[int, ...], dtype: Any, mesh: Any) -> Any:
    """A batch split over the mesh's chips along its first axis (replicated when
    the chips do not divide it)."""
    spec = P("data") if shape[0] % mesh.size == 0 else P()
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


# --------------------------------------------------------------------------------------
# Ratios, Pareto front, targets.


def add_ratios(rows: list[dict[str, Any]], base: str = "None") -> None:
    """Add `temp_ratio`, `flops_ratio`, `time_ratio` to each row: against the
    `eqx_remat` row of checkpoint `base` in the same group."""
    bases = {
        r["group"]: r
        for r in rows
        if r["impl"] == "eqx_remat" and r["checkpoint"] == base
    }
    for r in rows:
        b = bases.get(r["group"])
        for key, out in (
            ("temp_bytes", "temp_ratio"),
            ("flops", "flops_ratio"),
            ("median_s", "time_ratio"),
        ):
            ok = b is not None and r.get(key) is not None and b.get(key)
            r[out] = r[key] / b[key] if ok else None


def pareto(rows: Sequence[dict[str, Any]], x: str, y: str) -> list[int]:
    """Indices of the rows not dominated in (`x`, `y`), both minimised."""
    pts = [
        (i, r[x], r[y])
        for i, r in enumerate(rows)
        if r.get(x) is not None and r.get(y) is not None
    ]
    front = []
    for i, a, b in pts:
        dominated = any(
            (c <= a and d <= b) and (c < a or d < b) for j, c, d in pts if j != i
        )
        if not dominated:
            front.append(i)
    return front


def mark_pareto(rows: list[dict[str, Any]], cost: str) -> None:
    """`pareto` (bool) on each row: on the (temp memory, `cost`) front of its
    group."""
    for r in rows:
        r["pareto"] = False
    for g in {r["group"] for r in rows}:
        idx = [i for i, r in enumerate(rows) if r["group"] == g]
        sub = [rows[i] for i in idx]
        for j in pareto(sub, "temp_bytes", cost):
            rows[idx[j]]["pareto"] = True


@dataclasses.dataclass
class Target:
    """A target of DESIGN.md, checked against measured numbers."""

    name: str
    met: bool | None  # None: could not be measured here
    measured: str
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------
# Output: JSON, CSV, rich tables, plots.


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if size == GiB else f"{n / size:.1f} {unit}"
    return f"{n} B"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def fmt_flops(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(data), indent=1) + "\n")
    tmp.replace(path)


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys and not isinstance(r[k], list | dict)]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in keys})


def console() -> Any:
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=160)


def rich_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]
) -> Any:
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(title), title_justify="left")
    for i, c in enumerate(columns):
        t.add_column(escape(c), justify="left" if i < 2 else "right")
    for r in rows:
        t.add_row(*[escape(str(x)) for x in r])
    return t


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def plot_tradeoff(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """For each group: temp memory against time ratio and against FLOPs ratio,
    one marker per implementation, the Pareto front (of all implementations)
    drawn as a step line."""
    pyplot = plt()
    groups = list(dict.fromkeys(r["group"] for r in rows))
    has_time = any(r.get("time_ratio") is not None for r in rows)
    costs = [("flops_ratio", "FLOPs / FLOPs of None")]
    if has_time:
        costs.insert(0, ("time_ratio", "step time / step time of None (median)"))
    fig, axes = pyplot.subplots(
        len(groups),
        len(costs),
        figsize=(6.5 * len(costs), 4.5 * len(groups)),
        squeeze=False,
    )
    markers = {"eqx_remat": "o", "hand-written": "s", "flax": "^"}
    for gi, g in enumerate(groups):
        sub = [r for r in rows if r["group"] == g]
        for ci, (cost, label) in enumerate(costs):
            ax = axes[gi][ci]
            for impl in dict.fromkeys(r["impl"] for r in sub):
                pts = [r for r in sub if r["impl"] == impl and r.get(cost) is not None]
                ax.scatter(
                    [r[cost] for r in pts],
                    [r["temp_bytes"] / MiB for r in pts],
                    marker=markers.get(impl, "D"),
                    label=impl,
                    s=40,
                    alpha=0.8,
                )
                if impl == "eqx_remat":
                    for r in pts:
                        ax.annotate(
                            r["checkpoint"],
                            (r[cost], r["temp_bytes"] / MiB),
                            fontsize=7,
                            xytext=(4, 3),
                            textcoords="offset points",
                        )
            front = sorted(
                (sub[i][cost], sub[i]["temp_bytes"] / MiB)
                for i in pareto(sub, "temp_bytes", cost)
            )
            if front:
                xs, ys = zip(*front)
                ax.step(xs, ys, where="post", color="k", lw=1, alpha=0.6)
                ax.scatter(
                    xs, ys, s=160, facecolors="none", edgecolors="k", label="Pareto"
                )
            ax.set_xlabel(label)
            ax.set_yscale("log")
            ax.set_ylabel("compiled temp memory (MiB, log)")
            ax.set_title(f"{g}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot.close(fig)

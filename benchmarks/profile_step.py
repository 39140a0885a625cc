"""Where a training step's time goes, per checkpoint: the gradient of the
`fit-a-budget` tutorial's model, compiled once per checkpoint and run; its
memory and cost as compiled, then wall, CPU and system time and page faults per
step; with `--trace`, the time of each kind of compiled op, inside and outside
the layer loops (benchmarks/README.md, "Why `None` is slower").

    python benchmarks/profile_step.py                          # d_model 128, seq 128
    python benchmarks/profile_step.py --d-model 256 --seq 256 --trace
    python benchmarks/profile_step.py --quick                  # tests
"""

import argparse
import collections
import dataclasses
import gzip
import json
import os
import re
import resource
import statistics
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax
import optax

import eqx_remat as er
from benchmarks import _cli, _console, _ending, _format, _models, _results, _table


CHECKPOINTS = ("None", "dots", "nothing")
# Each compiled op reports its own time to the profiler (read by `--trace`).
XPROF_FLAG = "--xla_cpu_enable_xprof_traceme=true"
KINDS = (  # an op's kind: the first whose pattern matches its name
    (r"wrapped_broadcast|(broadcast|copy)(?!.*fusion)", "broadcast/copy"),
    (r"dot|ynn_fusion|.*convolution", "matmul"),
    (r".*dynamic-update-slice", "dynamic-update-slice"),
    (r"while", None),  # its body's ops are counted
    (r"", "other"),
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One checkpoint's step: as compiled, then timed (the fields the table
    reads)."""

    checkpoint: str
    temp_bytes: int
    saved_bytes: int
    xla_bytes_accessed: float
    flops: int
    wall_ratio: float
    cpu_ratio: float
    sys_s: float
    page_faults: float
    profile_s: dict | None = None  # with --trace: op time per kind


C = _table.Column
COLUMNS: list[_table.Column[Row]] = [
    C("checkpoint", lambda r: r.checkpoint),
    C("temp", lambda r: _format.fmt_bytes(r.temp_bytes)),
    C("saved", lambda r: _format.fmt_bytes(r.saved_bytes)),
    C("XLA bytes", lambda r: _format.fmt_bytes(int(r.xla_bytes_accessed))),
    C("FLOPs", lambda r: _format.fmt_flops(r.flops)),
    C("wall", lambda r: f"{r.wall_ratio:.3f}x"),
    C("CPU", lambda r: f"{r.cpu_ratio:.3f}x"),
    C("sys ms", lambda r: f"{r.sys_s * 1e3:.1f}"),
    C("faults", lambda r: f"{r.page_faults:.0f}"),
]
"""The step's table (nothing here is reported in markdown: no results file of
it is committed, its figures depend on the machine's load)."""


def _parser() -> argparse.ArgumentParser:
    p = _cli.parser(__doc__ or "", repeats=7, target=False)
    _cli.int_flag(p, "--d-model", 128, "model width")
    _cli.int_flag(p, "--seq", 128, "tokens per example")
    _cli.int_flag(p, "--batch", 4, "examples per step")
    _cli.int_flag(p, "--layers", 8, "decoder blocks")
    _cli.int_flag(p, "--steps", 3, "steps per timed round")
    p.add_argument(
        "--trace",
        action="store_true",
        help="profile each checkpoint's ops (default: off)",
    )
    return p


def _loss(model: eqx.Module, tokens: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(tokens[:, :-1])
    labels = tokens[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _compile(preset: _models.TransformerPreset, spec: str) -> tuple[dict, tuple]:
    """The gradient step under `spec`, compiled, and what is known without running
    it: a row, and `(compiled, its arguments)`."""
    model = preset.make(er.parse_checkpoint(spec, preset.depth), jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    tokens = preset.inputs()

    def loss(params: eqx.Module, tokens: jax.Array) -> jax.Array:
        return _loss(eqx.combine(params, static), tokens)

    step = jax.grad(loss)
    compiled = jax.jit(step).lower(params, tokens).compile()
    memory = compiled.memory_analysis()
    assert memory is not None, "this backend has no memory analysis"
    cost = compiled.cost_analysis() or {}
    saved = [
        r
        for r in er.residuals(loss, params, tokens)
        if "inside a scan" in r.source and "argument" not in r.source
    ]
    row = {
        "checkpoint": spec,
        "temp_bytes": memory.temp_size_in_bytes,
        "saved_bytes": sum(r.nbytes for r in saved),
        "saved_arrays": len(saved),
        "xla_bytes_accessed": int(cost.get("bytes accessed", 0)),
        "xla_flops": int(cost.get("flops", 0)),
        "flops": int(er.count_flops(step, params, tokens)),
    }
    return row, (compiled, (params, tokens))


def _round(compiled, args: tuple, steps: int) -> dict[str, float]:
    """Wall, CPU (user + system) and system seconds and minor page faults, per
    step, over `steps` steps."""
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(compiled(*args))
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    return {
        "wall_s": (t1 - t0) / steps,
        "cpu_s": cpu / steps,
        "sys_s": (r1.ru_stime - r0.ru_stime) / steps,
        "page_faults": (r1.ru_minflt - r0.ru_minflt) / steps,
    }


def _time(runs: dict, steps: int, rounds: int) -> dict[str, dict[str, float]]:
    """`_round`'s medians over `rounds` interleaved rounds, after a warm-up."""
    for compiled, args in runs.values():
        jax.block_until_ready(compiled(*args))
    got = collections.defaultdict(list)
    for _ in range(rounds):
        for k, run in runs.items():
            got[k].append(_round(*run, steps))
    return {
        k: {m: statistics.median(r[m] for r in rs) for m in rs[0]}
        for k, rs in got.items()
    }


def _computations(hlo: str) -> tuple[dict[str, str], set[str]]:
    """Each instruction's computation, and the computations that are loop
    bodies (reached from a `while`, directly or through calls/fusions)."""
    where, calls, bodies, current = {}, collections.defaultdict(set), set(), None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.-]+) ", line)
        if head and not line.startswith(" "):
            current = head.group(1)
            continue
        inst = re.match(r"\s+(?:ROOT )?%?([\w.-]+) = ", line)
        if inst and current:
            where[inst.group(1)] = current
            calls[current] |= set(re.findall(r"(?:calls|to_apply)=%?([\w.-]+)", line))
            bodies |= set(re.findall(r"body=%?([\w.-]+)", line))
    todo = list(bodies)
    while todo:
        for c in calls[todo.pop()] - bodies:
            bodies.add(c)
            todo.append(c)
    return where, bodies


def _profile(compiled, args: tuple, steps: int) -> dict[str, float]:
    """Seconds per step of the compiled ops, by place (outside/inside the layer
    loops) and `KINDS`, from one `jax.profiler` trace (both threads summed)."""
    where, bodies = _computations(compiled.as_text())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(compiled(*args))
        (path,) = Path(d).rglob("perfetto_trace.json.gz")
        events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    out = collections.Counter()
    for e in events:
        op = e.get("args", {}).get("hlo_op")
        if e.get("ph") != "X" or op not in where:
            continue
        kind = next(k for pattern, k in KINDS if re.match(pattern, op))
        if kind is not None:
            place = "in loops" if where[op] in bodies else "outside"
            out[f"{place}: {kind}"] += e["dur"] * 1e-6 / steps
    return dict(sorted(out.items()))


def _problem(args) -> str | None:
    if args.d_model % (heads := _models.TransformerPreset.heads):
        what = f"must be divisible by {heads}, the number of heads"
        return f"argument --d-model: {what}. Got {args.d_model}."
    return _cli.depth_problem(args.checkpoint, {"--layers": args.layers})


def main(argv: list[str] | None = None) -> None:
    if XPROF_FLAG not in os.environ.get("XLA_FLAGS", ""):  # before JAX's backend
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XPROF_FLAG}"
    quick = {"d_model": 32, "seq": 16, "layers": 2, "repeats": 2, "steps": 1}
    args = _cli.parse_args(_parser(), argv, "profile_step", quick=quick, check=_problem)
    preset = _models.TransformerPreset(
        batch=args.batch, seq=args.seq, d_model=args.d_model, layers=args.layers
    )
    specs = args.checkpoint or list(CHECKPOINTS)
    rows, runs = zip(*(_compile(preset, spec) for spec in specs))
    times = _time(dict(zip(specs, runs)), args.steps, args.repeats)
    for row, run in zip(rows, runs):
        row.update(times[row["checkpoint"]])
        row["wall_ratio"] = row["wall_s"] / times[specs[0]]["wall_s"]
        row["cpu_ratio"] = row["cpu_s"] / times[specs[0]]["cpu_s"]
        if args.trace:
            row["profile_s"] = _profile(*run, args.steps)
    what = (
        f"gradient step, d_model {args.d_model}, seq {args.seq}, batch "
        f"{args.batch}, {args.layers} layers, f32; medians of {args.repeats} "
        f"interleaved rounds of {args.steps} steps; ratios against {specs[0]}"
    )
    data = {"meta": _results.meta(args, describe=what), "rows": list(rows)}
    _ending.finish(
        args, _console.Console(), data, stem="profile_step", plot=None, show=show
    )


def show(console: _console.Console, data: dict, where: str) -> None:
    """The step's table; with `--trace`, the time of each kind of op."""
    rows = _table.read_all(Row, data["rows"])
    _table.show(console, data["meta"]["describe"], COLUMNS, rows, left=1)
    traced = [r for r in rows if r.profile_s is not None]
    if traced:
        kinds = sorted({k for r in traced for k in r.profile_s or {}})
        console.table(
            "op time per step (ms, both threads summed; traced, so slower)",
            ["ops", *(r.checkpoint for r in traced)],
            [
                [k, *(f"{(r.profile_s or {}).get(k, 0) * 1e3:.1f}" for r in traced)]
                for k in kinds
            ],
        )


if __name__ == "__main__":
    main()

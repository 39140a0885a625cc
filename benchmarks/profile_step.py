"""Where a training step's time goes, per checkpoint: the gradient of the
`fit-a-budget` tutorial's model (`zoo.Transformer`, vocab 256, 4 heads, GELU,
`"xla"` attention, float32; cross-entropy of `jax.vmap(model)`,
`eqx.filter_grad`), compiled once per checkpoint and run.

Per checkpoint: compiled temp bytes, the bytes of the residuals saved across the
layer stack (`eqx_remat.residuals`), XLA's `cost_analysis()` FLOPs and "bytes
accessed" (a loop body counted once), `count_flops`; then, interleaved rounds of
`--steps` steps after a warm-up (medians of `--repeats` rounds): wall time, the
process's CPU time (user + system: less sensitive to other processes on a
shared machine than wall time), its system time and its minor page faults per
step. With `--trace`, one `jax.profiler` trace per checkpoint gives the time of
each compiled op, grouped: outside the layer loops (the zero-filled stacked
buffers of `lax.scan`'s outputs: broadcasts and copies), and inside them
(matrix products, dynamic-update-slices, other fusions). benchmarks/README.md,
"Why `None` is slower", reads these figures.

    python benchmarks/profile_step.py                          # d_model 128, seq 128
    python benchmarks/profile_step.py --d-model 256 --seq 256 --trace
    python benchmarks/profile_step.py --quick                  # tests
"""

import argparse
import collections
import gzip
import json
import os
import re
import resource
import statistics
import tempfile
import time
from pathlib import Path


# Each compiled op reports its own time to the profiler (read by `--trace`).
_FLAG = "--xla_cpu_enable_xprof_traceme=true"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import eqx_remat as er  # noqa: E402
import zoo  # noqa: E402
from benchmarks import _common  # noqa: E402


CHECKPOINTS = ("None", "dots", "nothing")


def _parser() -> argparse.ArgumentParser:
    p = _common.parser(__doc__ or "", repeats=7, target=False)
    _common.int_flag(p, "--d-model", 128, "model width")
    _common.int_flag(p, "--seq", 128, "tokens per example")
    _common.int_flag(p, "--batch", 4, "examples per step")
    _common.int_flag(p, "--layers", 8, "decoder blocks")
    _common.int_flag(p, "--steps", 3, "steps per timed round")
    p.add_argument("--trace", action="store_true",
                   help="profile each checkpoint's ops (default: off)")  # fmt: skip
    return p


def _model(args, checkpoint):
    return zoo.Transformer(
        vocab_size=256, max_len=args.seq, d_model=args.d_model, num_heads=4,
        num_layers=args.layers, checkpoint=checkpoint, key=jax.random.key(0),
    )  # fmt: skip


def _loss(model, tokens):
    logits = jax.vmap(model)(tokens[:, :-1])
    labels = tokens[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _measures(args, spec):
    """Compile the gradient step under `spec`; what can be known without running."""
    params, static = eqx.partition(
        _model(args, _common.parse_checkpoint(spec)), eqx.is_array
    )
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, 256)

    def step(params, tokens):
        return eqx.filter_grad(_loss)(eqx.combine(params, static), tokens)

    compiled = jax.jit(step).lower(params, tokens).compile()
    memory = compiled.memory_analysis()
    assert memory is not None, "this backend has no memory analysis"
    cost = compiled.cost_analysis() or {}
    saved = [
        r
        for r in er.residuals(
            lambda p, t: _loss(eqx.combine(p, static), t), params, tokens
        )
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
    return row, compiled, (params, tokens)


def _time(runs, steps, rounds):
    """Medians over interleaved rounds: wall, CPU and system seconds, and minor
    page faults, per step."""
    for fn, a in runs.values():  # warm-up
        jax.block_until_ready(fn(*a))
    got = {k: collections.defaultdict(list) for k in runs}
    for _ in range(rounds):
        for k, (fn, a) in runs.items():
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for _ in range(steps):
                jax.block_until_ready(fn(*a))
            t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            cpu = lambda r: r.ru_utime + r.ru_stime  # noqa: E731
            got[k]["wall_s"].append((t1 - t0) / steps)
            got[k]["cpu_s"].append((cpu(r1) - cpu(r0)) / steps)
            got[k]["sys_s"].append((r1.ru_stime - r0.ru_stime) / steps)
            got[k]["page_faults"].append((r1.ru_minflt - r0.ru_minflt) / steps)
    return {k: {m: statistics.median(v) for m, v in d.items()} for k, d in got.items()}


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


def _kind(op: str) -> str | None:
    if op.startswith(("wrapped_broadcast", "broadcast", "copy.", "copy")) and (
        "fusion" not in op or op.startswith("wrapped_broadcast")
    ):
        return "broadcast/copy"
    if op.startswith(("dot", "ynn_fusion")) or "convolution" in op:
        return "matmul"
    if "dynamic-update-slice" in op:
        return "dynamic-update-slice"
    if op.startswith("while"):
        return None  # its body's ops are counted
    return "other"


def _profile(compiled, a, steps: int) -> dict[str, float]:
    """Seconds per step of the compiled ops, by place (outside/inside the layer
    loops) and kind, from one `jax.profiler` trace (ops on both threads summed)."""
    where, bodies = _computations(compiled.as_text())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(compiled(*a))
        (path,) = Path(d).rglob("perfetto_trace.json.gz")
        events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    out = collections.Counter()
    for e in events:
        op = e.get("args", {}).get("hlo_op")
        if e.get("ph") != "X" or op is None or op not in where:
            continue
        kind = _kind(op)
        if kind is not None:
            place = "in loops" if where[op] in bodies else "outside"
            out[f"{place}: {kind}"] += e["dur"] * 1e-6 / steps
    return dict(sorted(out.items()))


def main(argv=None) -> None:
    args = _common.parse_args(_parser(), argv, "profile_step")
    if args.quick:
        args.d_model, args.seq, args.layers, args.repeats, args.steps = 32, 16, 2, 2, 1
    specs = args.checkpoint or list(CHECKPOINTS)
    console = _common.Console()
    rows, runs = [], {}
    for spec in specs:
        row, compiled, a = _measures(args, spec)
        rows.append(row)
        runs[spec] = (compiled, a)
    times = _time(runs, args.steps, args.repeats)
    base = times[specs[0]]
    for row in rows:
        t = times[row["checkpoint"]]
        row.update(t)
        row["wall_ratio"] = t["wall_s"] / base["wall_s"]
        row["cpu_ratio"] = t["cpu_s"] / base["cpu_s"]
        if args.trace:
            compiled, a = runs[row["checkpoint"]]
            row["profile_s"] = _profile(compiled, a, args.steps)
    title = (
        f"gradient step, d_model {args.d_model}, seq {args.seq}, batch {args.batch}, "
        f"{args.layers} layers, f32; medians of {args.repeats} interleaved rounds "
        f"of {args.steps} steps; ratios against {specs[0]}"
    )
    columns = ["checkpoint", "temp", "saved", "XLA bytes", "FLOPs", "wall", "CPU",
               "sys ms", "faults"]  # fmt: skip
    size = _common.fmt_bytes
    console.table(title, columns, [
        [r["checkpoint"], size(r["temp_bytes"]), size(r["saved_bytes"]),
         size(r["xla_bytes_accessed"]), _common.fmt_flops(r["flops"]),
         f"{r['wall_ratio']:.3f}x", f"{r['cpu_ratio']:.3f}x",
         f"{r['sys_s'] * 1e3:.1f}", f"{r['page_faults']:.0f}"]
        for r in rows
    ])  # fmt: skip
    if args.trace:
        kinds = sorted({k for r in rows for k in r["profile_s"]})
        console.table(
            "op time per step (ms, both threads summed; traced, so slower)",
            ["ops", *specs],
            [
                [k, *(f"{r['profile_s'].get(k, 0) * 1e3:.1f}" for r in rows)]
                for k in kinds
            ],
        )
    data = {"meta": _common.meta(args), "rows": rows}
    if _common.is_main():
        _common.write_json(args.out / "profile_step.json", data)
        console.print(f"wrote {args.out / 'profile_step.json'}")


if __name__ == "__main__":
    main()

"""Offline binomial checkpointing vs Equinox's online treeverse on a deep chain.

A ResidualChain-like stack, `x ↦ x + tanh(x @ W_i)`, width 128, batch 4096, f32
(2 MiB per carry), depth 1024. For each number of slots `s`, the gradient of
`sum(stack(x))` is compiled with

- `eqx_remat.scan_layers(..., checkpoint=eqx_remat.binomial(s))`: the revolve
  schedule for (D, s), computed offline;
- `equinox.internal.scan(..., kind="checkpointed", checkpoints=s)`: treeverse, an
  online schedule with `s` checkpoints;

and the script reports compiled temp memory, median wall time of a gradient step
after warm-up (as a ratio, measured side by side in one run), and the number of
layer forward evaluations. Evaluations are counted at run time by a
`jax.debug.callback` in the layer, on a copy of the chain with width 2 (the
schedules do not depend on the width); the count includes the forward pass and
excludes the one evaluation inside each layer's own `vjp` (the cost model of
`eqx_remat.binomial`'s docstring, whose optimum is printed alongside); `calls`
adds those back (every call of the layer, the convention of the issue's
reference numbers).

    JAX_PLATFORMS=cpu python benchmarks/binomial_vs_treeverse.py
    JAX_PLATFORMS=cpu python benchmarks/binomial_vs_treeverse.py --slots 10 \
        --repeats 5 --json binomial_vs_treeverse.json

`--compile-depths 64 4096` also times tracing + compiling binomial's gradient at
those depths (the program is O(log D), so the times should be close).
"""

import argparse
import json
import os
import statistics
import time


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import equinox.internal as eqxi  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import eqx_remat  # noqa: E402
from eqx_remat._binomial import optimal_evaluations  # noqa: E402


_COUNT = [0]


def _tick(_):
    _COUNT[0] += 1


class Layer(eqx.Module):
    w: jax.Array
    count: bool = eqx.field(static=True, default=False)

    def __call__(self, x):
        if self.count:
            jax.debug.callback(_tick, x)  # depends on x: not hoisted out of loops
        return x + jnp.tanh(x @ self.w)


def make_layers(depth, width, count=False):
    def make(k):
        return Layer(jax.random.normal(k, (width, width)) / (2 * width**0.5), count)

    return eqx_remat.stack(make, jax.random.split(jax.random.key(0), depth))


def binomial_grad(slots):
    def loss(layers, x):
        out = eqx_remat.scan_layers(layers, x, checkpoint=eqx_remat.binomial(slots))
        return jnp.sum(out)

    return jax.jit(jax.grad(loss))


def treeverse_grad(slots):
    def loss(layers, x):
        params, static = eqx.partition(layers, eqx.is_array)
        body = lambda c, p: (eqx.combine(p, static)(c), None)
        out, _ = eqxi.scan(body, x, params, kind="checkpointed", checkpoints=slots)
        return jnp.sum(out)

    return jax.jit(jax.grad(loss))


def plain_grad():
    def loss(layers, x):
        return jnp.sum(eqx_remat.scan_layers(layers, x))

    return jax.jit(jax.grad(loss))


def count_evaluations(grad, depth):
    layers = make_layers(depth, 2, count=True)
    x = jnp.ones((1, 2))
    jax.effects_barrier()
    _COUNT[0] = 0
    jax.block_until_ready(grad(layers, x))
    jax.effects_barrier()
    # One evaluation per layer happens inside its own vjp (the backward step).
    return _COUNT[0] - depth


def measure(grads, layers, x, repeats):
    """Compile each gradient, warm it up, then time them in turns (A B A B ...),
    so that the load of a shared machine hits them alike."""
    out = {}
    for name, grad in grads.items():
        t0 = time.perf_counter()
        compiled = grad.lower(layers, x).compile()
        out[name] = {
            "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "compile_s": time.perf_counter() - t0,
            "times_s": [],
            "compiled": compiled,
        }
        jax.block_until_ready(compiled(layers, x))  # warm-up
    for _ in range(repeats):
        for m in out.values():
            t0 = time.perf_counter()
            jax.block_until_ready(m["compiled"](layers, x))
            m["times_s"].append(time.perf_counter() - t0)
    for m in out.values():
        del m["compiled"]
        m["median_s"] = statistics.median(m["times_s"]) if repeats else float("nan")
    return out


def compile_times(depths, slots, width, batch):
    rows = []
    for depth in depths:
        layers = jax.eval_shape(lambda: make_layers(depth, width))
        x = jax.ShapeDtypeStruct((batch, width), jnp.float32)
        t0 = time.perf_counter()
        lowered = binomial_grad(slots).lower(layers, x)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        rows.append({"depth": depth, "trace_s": t1 - t0, "compile_s": t2 - t1})
        print(
            f"binomial({slots}) D={depth}: trace+lower {t1 - t0:.2f} s, "
            f"compile {t2 - t1:.2f} s",
            flush=True,
        )
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=1024)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--slots", type=int, nargs="+", default=[4, 10, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-time", action="store_true", help="memory and counts only")
    p.add_argument("--compile-depths", type=int, nargs="*", default=[])
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()

    depth = args.depth
    layers = make_layers(depth, args.width)
    x = jax.random.normal(jax.random.key(1), (args.batch, args.width))
    carry = args.batch * args.width * 4
    print(
        f"D={depth}, width {args.width}, batch {args.batch}, f32 "
        f"({carry / 2**20:.1f} MiB per carry), {jax.devices()[0].platform}",
        flush=True,
    )
    results = {"config": vars(args), "rows": [], "compile": []}
    header = (
        f"{'slots':>5}  {'schedule':<10} {'temp MiB':>9} {'mem ratio':>9} "
        f"{'median s':>9} {'time ratio':>10} {'evals':>6} {'optimum':>7} "
        f"{'calls':>6}"
    )
    print(header, flush=True)
    for s in args.slots:
        ours_g, theirs_g = binomial_grad(s), treeverse_grad(s)
        evals = {
            "binomial": count_evaluations(ours_g, depth),
            "treeverse": count_evaluations(theirs_g, depth),
        }
        row = {"slots": s, "optimum": optimal_evaluations(depth, s)}
        grads = {"binomial": ours_g, "treeverse": theirs_g}
        row |= measure(grads, layers, x, 0 if args.no_time else args.repeats)
        for name in grads:
            row[name]["evaluations"] = evals[name]
        t = row["treeverse"]
        for name in ("binomial", "treeverse"):
            m = row[name]
            print(
                f"{s:>5}  {name:<10} {m['temp_bytes'] / 2**20:>9.1f} "
                f"{m['temp_bytes'] / t['temp_bytes']:>9.3f} {m['median_s']:>9.3f} "
                f"{m['median_s'] / t['median_s']:>10.3f} {m['evaluations']:>6} "
                f"{row['optimum']:>7} {m['evaluations'] + depth:>6}",
                flush=True,
            )
        results["rows"].append(row)
    if args.compile_depths:
        for s in args.slots:
            results["compile"] += compile_times(
                args.compile_depths, s, args.width, args.batch
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

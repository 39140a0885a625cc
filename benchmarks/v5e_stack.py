"""Per-chip memory of a transformer-like stack on TPU v5e, compiled ahead of time.

A stack of pre-norm blocks (causal multi-head attention + GELU MLP, written inline
here, no zoo), bf16, d_model 1024, 16 layers, sequence 2048, batch 8 split across
the 4 chips of a v5e 2x2 slice over the mesh axis "data". One training gradient is
compiled for TPU v5e with libtpu — no TPU needed — under each `checkpoint` of
`eqx_remat.scan_layers`, and `eqx_remat.memory_report` gives the per-chip memory
and the FLOPs of the whole step.

    JAX_PLATFORMS=cpu python benchmarks/v5e_stack.py
    JAX_PLATFORMS=cpu python benchmarks/v5e_stack.py --checkpoint None dots nothing \
        --json v5e_stack.json

`--no-vmem` also compiles with VMEM memory-space assignment turned off, so that
every intermediate is counted in HBM temp bytes (see `memory_report`'s docs).
Needs the `tpu` extra: `pip install 'eqx-remat[tpu]'`.
"""

import argparse
import json
import math
import os
import re
import time


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_remat  # noqa: E402


class Block(eqx.Module):
    """Pre-norm causal self-attention + MLP on `(batch, seq, d_model)`."""

    wqkv: jax.Array
    wo: jax.Array
    w1: jax.Array
    w2: jax.Array
    heads: int = eqx.field(static=True)

    def __call__(self, x):
        b, s, d = x.shape
        h = self.heads
        qkv = checkpoint_name(_norm(x) @ self.wqkv, "qkv_proj")
        q, k, v = jnp.split(qkv.reshape(b, s, 3 * h, d // h), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        scores = scores / math.sqrt(d // h)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
        p = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, d)
        x = x + checkpoint_name(ctx @ self.wo, "out_proj")
        hidden = checkpoint_name(jax.nn.gelu(_norm(x) @ self.w1), "mlp_hidden")
        return x + checkpoint_name(hidden @ self.w2, "mlp_out")


def _norm(x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return x32.astype(x.dtype)


def grad_fn(checkpoint):
    def loss(blocks, x):
        out = eqx_remat.scan_layers(blocks, x, checkpoint=checkpoint)
        return jnp.mean(out.astype(jnp.float32) ** 2)

    return jax.grad(loss)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5e")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--checkpoint", nargs="+", default=["None", "dots", "nothing"])
    parser.add_argument("--no-vmem", action="store_true")
    parser.add_argument("--json", help="write the reports to this file")
    args = parser.parse_args()

    d, n, dt = args.d_model, args.layers, jnp.bfloat16
    S = jax.ShapeDtypeStruct
    blocks = Block(
        wqkv=S((n, d, 3 * d), dt),
        wo=S((n, d, d), dt),
        w1=S((n, d, 4 * d), dt),
        w2=S((n, 4 * d, d), dt),
        heads=args.heads,
    )
    mesh = eqx_remat.v5e_mesh(args.target)
    x = S((args.batch, args.seq, d), dt, sharding=NamedSharding(mesh, P("data")))
    print(
        f"target {args.target} ({mesh.size} chips), d_model {d}, {n} layers, "
        f"{args.heads} heads, seq {args.seq}, batch {args.batch} over 'data', bf16"
    )
    variants = [("default", None)]
    if args.no_vmem:
        variants.append(("no-vmem", {"xla_vf_vmem_memory_space_assignment": False}))
    rows = []
    for spec in args.checkpoint:
        checkpoint = None if spec == "None" else spec
        for variant, options in variants:
            t0 = time.perf_counter()
            try:
                r = eqx_remat.memory_report(
                    grad_fn(checkpoint),
                    blocks,
                    x,
                    target=args.target,
                    compiler_options=options,
                )
            except jax.errors.JaxRuntimeError as e:
                # XLA refuses programs that do not fit in a chip's HBM, and says
                # how much they would need.
                need = re.search(r"required for HLO temporaries \(([^)]*)\)", str(e))
                have = re.search(r"exceeds available HBM \(([^)]*)\)", str(e))
                if need is None:
                    raise
                print(
                    f"checkpoint={spec!s:8} {variant:8} does not fit: XLA needs "
                    f"{need.group(1)} of temporaries per chip, "
                    f"{have and have.group(1)} of HBM available"
                )
                rows.append(
                    {
                        "checkpoint": spec,
                        "compile": variant,
                        "fits": False,
                        "xla_required_temporaries": need.group(1),
                    }
                )
                continue
            secs = time.perf_counter() - t0
            print(f"checkpoint={spec!s:8} {variant:8} {r}  ({secs:.0f} s to compile)")
            rows.append(
                {"checkpoint": spec, "compile": variant, "fits": True, **r.to_dict()}
            )
    base = {
        row["compile"]: row
        for row in rows
        if row["checkpoint"] == "None" and row["fits"]
    }
    for row in rows:
        b = base.get(row["compile"])
        if b and b["temp_bytes"] and row["fits"] and row["checkpoint"] != "None":
            print(
                f"{row['checkpoint']:>8} vs None ({row['compile']}): temp "
                f"{row['temp_bytes'] / b['temp_bytes']:.3f}x, FLOPs "
                f"{row['flops'] / b['flops']:.3f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Compiled temp memory (MiB) of the gradient of a residual tanh stack (width 128,
batch 4096, f32) under each core schedule, against equinox.internal.scan
(online treeverse, log2 D checkpoints).

Usage: python benchmarks/schedule_memory.py [D ...]   (default 64 256 1024)
"""

import os
import sys
import time


os.environ.setdefault("JAX_PLATFORMS", "cpu")
import math  # noqa: E402

import equinox as eqx  # noqa: E402
import equinox.internal as eqxi  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import eqx_remat as er  # noqa: E402


class Layer(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w)


W, B = 128, 4096


def mib(f, *a):
    t = time.time()
    c = jax.jit(f).lower(*a).compile()
    return round(c.memory_analysis().temp_size_in_bytes / 2**20, 1), round(
        time.time() - t, 1
    )


for D in [int(a) for a in sys.argv[1:]] or [64, 256, 1024]:
    layers = er.stack(
        lambda k: Layer(jax.random.normal(k, (W, W)) / 30),
        jax.random.split(jax.random.key(0), D),
    )
    x = jax.ShapeDtypeStruct((B, W), jnp.float32)
    layers = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers)

    def loss(ck):
        return lambda ls, x: er.scan_layers(ls, x, checkpoint=ck).sum()

    def tv(ls, x):
        p, s = eqx.partition(ls, eqx.is_array)

        def body(c, p):
            return eqx.combine(p, s)(c), None

        return eqxi.scan(
            body, x, p, kind="checkpointed", checkpoints=int(math.log2(D))
        )[0].sum()

    out = {"D": D}
    for name, f in [
        ("none", loss(None)),
        ("plain", loss("nothing")),
        ("every", loss(er.every(int(round(math.sqrt(D)))))),
        ("nested2", loss(er.nested(2))),
        ("nested3", loss(er.nested(3))),
        ("recursive", loss(er.recursive())),
        ("treeverse", tv),
    ]:
        out[name] = mib(jax.grad(f), layers, x)
    print(out, flush=True)

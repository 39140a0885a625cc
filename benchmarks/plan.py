"""Plan the checkpointing of a preset model for a memory budget.

Builds a zoo model abstractly (`eqx.filter_eval_shape`: nothing is allocated),
then `eqx_remat.plan` compiles one training gradient per candidate checkpoint
ahead of time and prints the table: memory, FLOPs, and which candidate — the
fewest FLOPs that fits — it chooses.

    JAX_PLATFORMS=cpu python benchmarks/plan.py --preset residual-chain --budget 2GiB
    JAX_PLATFORMS=cpu python benchmarks/plan.py --preset transformer \
        --budget 16GiB --target v5e

Presets (per example; the batch is `jax.vmap`ped, the Equinox convention):

- `residual-chain`: `zoo.ResidualChain(width=256, depth=1024)`, batch 4096
  (4 MiB per carry, 256 MiB of weights).
- `transformer`: `zoo.Transformer(vocab 32000, d_model 1024, 16 heads, 16 layers)`,
  sequence 2048, batch 8, f32.
- `mlp`: `zoo.MLP(1024 -> 1024, width 4096, depth 32)`, batch 1024.
"""

import argparse
import os
import sys
import time


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import eqx_remat  # noqa: E402
import zoo  # noqa: E402


def preset(name):
    """`(grad_fn, model, batch)` with abstract arrays."""
    key = jax.random.key(0)
    if name == "residual-chain":
        model = eqx.filter_eval_shape(lambda: zoo.ResidualChain(256, 1024, key=key))
        batch = jax.ShapeDtypeStruct((4096, 256), jnp.float32)

        def loss(model, x):
            return jnp.mean(jax.vmap(model)(x) ** 2)

    elif name == "transformer":
        model = eqx.filter_eval_shape(
            lambda: zoo.Transformer(32000, 2048, 1024, 16, 16, key=key)
        )
        batch = jax.ShapeDtypeStruct((8, 2048), jnp.int32)

        def loss(model, tokens):
            logits = jax.vmap(model)(tokens)[:, :-1].astype(jnp.float32)
            logp = jax.nn.log_softmax(logits)
            target = tokens[:, 1:, None]
            return -jnp.mean(jnp.take_along_axis(logp, target, axis=-1))

    elif name == "mlp":
        model = eqx.filter_eval_shape(lambda: zoo.MLP(1024, 1024, 4096, 32, key=key))
        batch = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)

        def loss(model, x):
            return jnp.mean(jax.vmap(model)(x) ** 2)

    else:
        raise ValueError(f"Unknown preset {name!r}.")
    return eqx.filter_grad(loss), model, batch


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset",
        default="residual-chain",
        choices=["residual-chain", "transformer", "mlp"],
    )
    p.add_argument("--budget", required=True, help="e.g. 16GiB, 512MiB, 1.5GB")
    p.add_argument("--target", default=None, help='e.g. "v5e" or "v5e:2x4"')
    args = p.parse_args()
    grad, model, batch = preset(args.preset)
    t0 = time.perf_counter()
    try:
        result = eqx_remat.plan(
            grad, model, batch, budget_bytes=args.budget, target=args.target
        )
    except ValueError as e:
        print(e)
        sys.exit(1)
    print(result)
    print(f"({len(result.table)} candidates in {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

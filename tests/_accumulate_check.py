"""`eqx_remat.accumulate` on 8 host CPU devices: data parallel and FSDP.

Run by tests/test_accumulate.py in a subprocess, because the device count is fixed
when JAX initialises; self-contained (run by hand: `python
tests/_accumulate_check.py`). Prints `ok` on success.

Checks, for a batch sharded over the devices along its batch axis (Auto and
Explicit mesh axes, the whole or the chunked loss head): the accumulated loss
and gradients equal one device's full-batch ones, and on Auto axes the
compiled program moves no example between devices (no `all-to-all`, no
`collective-permute`; under data parallelism no `all-gather` either: only the
gradients' `all-reduce`).
"""

import os


_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import eqx_remat  # noqa: E402
import zoo  # noqa: E402


jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

DEVICES = 8
# f32: the sharded, accumulated program sums in another order. Seen: ~1e-7.
RTOL, ATOL = 1e-5, 1e-6


def loss(model, tokens):
    return jax.vmap(model.loss)(tokens[:, :-1], tokens[:, 1:]).mean()


def main():
    assert jax.device_count() == DEVICES, jax.devices()
    model = zoo.Transformer(32, 8, 16, 2, 2, checkpoint="dots", key=jr.key(0))
    # 32 sequences: 4 per device, 2 micro-batches of 2 on each.
    tokens = jr.randint(jr.key(1), (32, 8), 0, 32)
    grad = eqx.filter_value_and_grad(loss)
    ref = eqx.filter_jit(grad)(model, tokens)
    accumulated = eqx_remat.accumulate(grad, 2)
    # The chunked loss head too (3 positions a chunk), from the same weights.
    chunked = zoo.set_loss_chunk_size(model, 3)
    for axis_type, fsdp, m in [
        (AxisType.Auto, False, model),
        (AxisType.Auto, True, model),
        (AxisType.Auto, True, chunked),
        (AxisType.Explicit, False, chunked),
        (AxisType.Explicit, True, model),
    ]:
        case = f"{axis_type}, fsdp={fsdp}, loss_chunk_size={m.loss_chunk_size}"
        mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(axis_type,))
        params, static = eqx.partition(zoo.shard(m, mesh, fsdp=fsdp), eqx.is_array)
        batch = zoo.shard_batch(tokens, mesh)
        step = jax.jit(lambda p, b: accumulated(eqx.combine(p, static), b))
        out = step(params, batch)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=case)
        if axis_type == AxisType.Explicit:
            continue
        hlo = step.lower(params, batch).compile().as_text()
        for op in ("all-to-all", "collective-permute"):
            assert op not in hlo, (case, op)
        if not fsdp:
            assert "all-gather" not in hlo, f"{case}: gathered an array"
            assert "all-reduce" in hlo, case
    print("ok")


if __name__ == "__main__":
    main()

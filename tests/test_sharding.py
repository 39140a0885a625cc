"""zoo.shard and zoo.shard_batch: data parallel and FSDP over a `jax.sharding.Mesh`.

The multi-device checks run tests/_sharded_check.py in a subprocess with 8 host CPU
devices, because the device count is fixed when JAX initialises.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import zoo


def run_sharded_check(*checks: str) -> None:
    script = Path(__file__).with_name("_sharded_check.py")
    env = dict(os.environ)
    flag = "--xla_force_host_platform_device_count=8"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(script), *checks],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert proc.stdout.splitlines()[-1] == "ok"


@pytest.mark.heavy
def test_sharded_gradients_equal_single_device_gradients():
    """On 8 devices, DP and FSDP gradients of the Transformer under `"dots"` and
    `recursive()` equal the single-device gradients (f32, rtol 1e-5, atol 1e-6),
    and come out sharded like the parameters when constrained with `zoo.shard`."""
    run_sharded_check("grads")


@pytest.mark.heavy
def test_padded_segments_keep_memory_space_and_sharding():
    """Depths that a schedule's split does not divide (3 and 5 layers): every
    schedule, with no inner policy or an offloading one (`offload_dots_no_batch`,
    `offload_names`), gives the gradient of no checkpointing with and without an
    Explicit mesh (8 devices), and so does a 3-layer Transformer under
    `every(2)`: the skip branch of a padded layer returns values of the exact
    types the layer's branch computes (memory space, sharding, weak type)."""
    run_sharded_check("padded")


@pytest.mark.heavy
def test_flash_attention_stays_per_device_under_every_schedule():
    """`jax.vmap(model, spmd_axis_name="data")` over a flash-attention Llama: the
    traced gradient's `shard_map` around the kernel has `in_specs` `P('data')`
    under every depth schedule (8 devices, interpret mode), not `P(None)`."""
    run_sharded_check("flash_specs")


@pytest.mark.heavy
def test_fsdp_gathers_one_layer_of_weights_not_the_activations():
    """On 8 devices with Auto axes, the compiled FSDP gradient step of a bf16
    Llama under `"nothing"` all-gathers only weights: one layer's (its matrices
    in bf16) or those outside the stack, never a layer's input over the whole
    batch."""
    run_sharded_check("gathers")


@pytest.mark.slow
def test_sharded_training():
    """On 8 devices, `benchmarks/train_lm.py --mesh fsdp:8`, resumed as
    `--mesh dp:8`, follows the single-device loss curve."""
    run_sharded_check("train")


@pytest.mark.slow
def test_explicit_mesh_gradients():
    """On 8 devices with Explicit mesh axes (`jax.make_mesh`'s default): the
    Transformer (GPT-2 and Llama blocks; DP and FSDP) and the MLP and
    ResidualChain (DP) give the single-device loss and gradients."""
    run_sharded_check("explicit")


def mesh(axis_type=AxisType.Auto, names=("data",)):
    return Mesh(np.array(jax.devices()[:1]), names, axis_types=(axis_type,))


def test_shard_one_device():
    m = mesh()
    tree = {"w": jnp.ones((8, 3)), "n": 3, "f": jnp.tanh}
    for fsdp in (False, True):
        out = zoo.shard(tree, m, fsdp=fsdp)
        assert out["n"] == 3 and out["f"] is jnp.tanh
        assert isinstance(out["w"].sharding, NamedSharding)
        # One device divides every size: FSDP picks the largest axis.
        spec = P("data", None) if fsdp else P(None, None)
        assert out["w"].sharding.spec == spec
    batch = zoo.shard_batch((jnp.ones((4, 2)), jnp.zeros(4, dtype=jnp.int32)), m)
    assert batch[0].sharding.spec == P("data", None)
    assert batch[1].sharding.spec == P("data")


def test_shard_abstract_arrays():
    """A `jax.ShapeDtypeStruct` gets its sharding attached, for ahead-of-time
    compilation; nothing is allocated."""
    m = mesh()
    abstract = jax.ShapeDtypeStruct((4, 16), jnp.float32)
    out = zoo.shard(abstract, m, fsdp=True)
    assert isinstance(out, jax.ShapeDtypeStruct)
    assert out.sharding == NamedSharding(m, P(None, "data"))
    out = zoo.shard_batch(abstract, m)
    assert out.sharding == NamedSharding(m, P("data", None))


def test_shard_inside_jit():
    m = mesh()

    @jax.jit
    def f(x):
        return zoo.shard(x * 2, m, fsdp=True), zoo.shard_batch(x + 1, m)

    x = jnp.ones((2, 6))
    # (On one device the constraint is trivial; the 8-device check sees its effect.)
    assert str(jax.make_jaxpr(f)(x)).count("sharding_constraint") == 2
    a, b = f(x)
    assert np.array_equal(a, 2 * x) and np.array_equal(b, x + 1)


def test_shard_errors():
    x = jnp.ones((4, 2))
    with pytest.raises(ValueError, match="expected a mesh with an axis named 'data'"):
        zoo.shard(x, mesh(names=("batch",)))
    with pytest.raises(ValueError, match="Got a mesh with axes \\('batch',\\)"):
        zoo.shard_batch(x, mesh(names=("batch",)))
    assert zoo.shard_batch(x, mesh(names=("batch",)), axis="batch").sharding.spec == P(
        "batch", None
    )
    with pytest.raises(ValueError, match="leading batch axis .* at batch\\['y'\\]"):
        zoo.shard_batch({"x": x, "y": jnp.float32(1)}, mesh())


@pytest.mark.heavy
@pytest.mark.parametrize("llama", [False, True], ids=["gpt2", "llama"])
def test_explicit_mesh_one_device(llama):
    """Sharding in types on one device: `zoo.shard` (FSDP) and `zoo.shard_batch`
    give arrays whose types carry the sharding; the Transformer's embedding
    gather and weight gathering type-check, and the loss and gradients equal the
    unsharded ones."""
    import equinox as eqx
    import jax.random as jr

    m = mesh(AxisType.Explicit)
    make = zoo.Transformer.llama if llama else zoo.Transformer
    model = make(16, 8, 8, 2, 2, tie_embeddings=llama, checkpoint="dots", key=jr.key(0))
    tokens = jr.randint(jr.key(1), (2, 8), 0, 16)

    def loss(model, tokens):
        logits = jax.vmap(model)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    ref_value, ref_grads = grad(model, tokens)
    sharded = zoo.shard(model, m, fsdp=True)
    batch = zoo.shard_batch(tokens, m)
    assert jax.typeof(batch).sharding.spec == P("data", None)
    assert jax.typeof(sharded.token_embedding.weight).sharding.spec == P("data", None)
    value, grads = grad(sharded, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6, atol=0)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

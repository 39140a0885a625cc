"""zoo.shard and zoo.shard_batch: data parallel and FSDP over a `jax.sharding.Mesh`.

The multi-device tests run on the 8 CPU devices that tests/conftest.py gives this
process (`jax_num_cpu_devices`); the others use a mesh of one device.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import eqx_remat
import zoo


# f32, 8-way: the sharded program sums the batch (and, under FSDP, the contractions)
# in another order than one device does. Seen: max relative difference ~1e-6.
RTOL, ATOL = 1e-5, 1e-6
DEVICES = 8


def loss(model, tokens):
    logits = jax.vmap(model)(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def expected_spec(shape, fsdp):
    """The rule of `zoo.shard`: the largest axis divisible by 8, first among
    equals, else replicated."""
    spec = [None] * len(shape)
    if fsdp:
        divisible = [i for i, n in enumerate(shape) if n % DEVICES == 0]
        if divisible:
            spec[max(divisible, key=lambda i: (shape[i], -i))] = "data"
    return P(*spec)


def check_allclose(name, actual, expected):
    # Leaf by leaf, not `eqx.tree_equal`: sharded and unsharded leaves compare
    # here, and a failure names the leaf.
    leaves = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    for a, b in leaves:
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL, err_msg=name
        )


@pytest.mark.heavy
def test_sharded_gradients_equal_single_device_gradients():
    """On 8 devices, DP and FSDP gradients of the Transformer under `"dots"` and
    `recursive()` equal the single-device gradients (f32, rtol 1e-5, atol 1e-6),
    and come out sharded like the parameters when constrained with `zoo.shard`."""
    assert jax.device_count() == DEVICES, jax.devices()
    mesh = jax.make_mesh(
        (DEVICES,),
        ("data",),
        axis_types=(AxisType.Auto,),
    )

    # d_model 12 is not divisible by 8: the fused qkv weight (3, 36, 12) has no
    # axis to split and stays replicated under FSDP, while the MLP's (3, 48, 12)
    # splits its 48.
    def make(key):
        return zoo.Transformer(32, 9, 12, 2, 3, key=key)

    # Random parameters from NumPy in place of the initialisation: gradients agree
    # for any parameters, and compiling the initialiser for 8 devices costs more
    # than the rest of this check.
    rng = np.random.default_rng(0)
    abstract = eqx.filter_eval_shape(make, jr.key(0))
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)

    def fill(x):
        if not is_abstract(x):
            return x
        return jnp.asarray(rng.normal(0, 0.5, x.shape).astype(x.dtype))

    model = jax.tree.map(fill, abstract, is_leaf=is_abstract)
    tokens = jnp.asarray(rng.integers(0, 32, (DEVICES, 9)), dtype=jnp.int32)

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    ref_loss, ref_grads = grad(model, tokens)

    batch = zoo.shard_batch(tokens, mesh)
    assert batch.sharding.spec == P("data", None), batch.sharding

    for checkpoint in ["dots", eqx_remat.recursive()]:
        for fsdp in [False, True]:
            name = f"checkpoint={checkpoint!r}, fsdp={fsdp}"
            sharded = zoo.shard(
                eqx_remat.set_checkpoint(model, checkpoint), mesh, fsdp=fsdp
            )
            params = jax.tree.leaves(eqx.filter(sharded, eqx.is_array))
            for x in params:
                assert x.sharding.spec == expected_spec(x.shape, fsdp), (name, x.shape)
            if fsdp:
                assert any(x.sharding.spec == P(None, None, None) for x in params)
                assert any("data" in x.sharding.spec for x in params)

            # Inside jit, zoo.shard constrains: the gradients come out sharded
            # like the parameters.
            @eqx.filter_jit
            def sharded_grad(m, b):
                value, grads = eqx.filter_value_and_grad(loss)(m, b)
                return value, zoo.shard(grads, mesh, fsdp=fsdp)

            value, grads = sharded_grad(sharded, batch)
            check_allclose(name, value, ref_loss)
            check_allclose(name, grads, ref_grads)
            for g, p in zip(jax.tree.leaves(grads), params, strict=True):
                assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (name, g.shape)

    try:
        zoo.shard_batch(tokens[:6], mesh)
    except ValueError as e:
        assert "divisible by the 8 devices of mesh axis 'data'" in str(e), e
        assert "Got shape (6, 9) at batch." in str(e), e
    else:
        raise AssertionError("shard_batch accepted a batch of 6 on 8 devices")


def test_data_and_fsdp_on_separate_mesh_axes():
    """On a 2 x 4 mesh, the parameters split 4 ways over `"fsdp"` and the batch 8
    ways over `("data", "fsdp")`: each chip holds a quarter of the split
    weights and an eighth of the batch, and the gradients equal one device's."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(1)
    abstract = eqx.filter_eval_shape(
        lambda: zoo.Transformer(32, 9, 16, 2, 2, key=jr.key(0))
    )
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    model = jax.tree.map(
        lambda x: (
            jnp.asarray(rng.normal(0, 0.5, x.shape).astype(x.dtype))
            if is_abstract(x)
            else x
        ),
        abstract,
        is_leaf=is_abstract,
    )
    tokens = jnp.asarray(rng.integers(0, 32, (DEVICES, 9)), dtype=jnp.int32)
    ref = eqx.filter_jit(eqx.filter_grad(loss))(model, tokens)

    sharded = zoo.shard(model, mesh, fsdp=True, axis="fsdp")
    batch = zoo.shard_batch(tokens, mesh, axis=("data", "fsdp"))
    assert batch.sharding.spec == P(("data", "fsdp"), None)
    assert batch.addressable_shards[0].data.shape == (1, 9)
    for x in jax.tree.leaves(eqx.filter(sharded, eqx.is_array)):
        dim = max(
            (i for i, n in enumerate(x.shape) if n % 4 == 0),
            key=lambda i: (x.shape[i], -i),
            default=None,
        )
        spec = [None] * x.ndim
        if dim is not None:
            spec[dim] = "fsdp"
        assert x.sharding.spec == P(*spec), x.shape
    grads = eqx.filter_jit(eqx.filter_grad(loss))(sharded, batch)
    check_allclose("data x fsdp", grads, ref)

    with pytest.raises(ValueError, match="an axis named 'model'"):
        zoo.shard_batch(tokens, mesh, axis=("data", "model"))


def _random(make, seed):
    """`make()`'s model with random parameters from NumPy (cheaper to compile
    for 8 devices than the initialiser)."""
    rng = np.random.default_rng(seed)
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    return jax.tree.map(
        lambda x: (
            jnp.asarray(rng.normal(0, 0.5, x.shape).astype(x.dtype))
            if is_abstract(x)
            else x
        ),
        eqx.filter_eval_shape(make),
        is_leaf=is_abstract,
    )


@pytest.mark.parametrize("llama", [False, True], ids=["gpt2", "llama"])
def test_tensor_parallel_gradients_equal_single_device_gradients(llama):
    """On a 2 x 2 x 2 mesh of `("data", "fsdp", "tensor")`: each projection
    split over `"tensor"` as Megatron-LM splits it (q/k/v and the MLP's first
    matrices by columns, the output projections by rows; grouped-query heads
    too), FSDP over `"fsdp"` on another axis, the batch over `("data",
    "fsdp")`. The gradients equal one device's, come out sharded like the
    parameters, and the program moves no activations between the devices of
    the axis but by gathers and sums: with the q/k/v columns laid out by head,
    each device's share is whole heads (no all-to-all, no permutation)."""
    mesh = jax.make_mesh(
        (2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3
    )
    options = dict(num_kv_heads=2, checkpoint="dots") if llama else {}
    build = zoo.Transformer.llama if llama else zoo.Transformer
    model = _random(
        lambda: build(32, 9, 16, 4, 2, d_ff=32, key=jr.key(0), **options), 2
    )
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 32, (DEVICES, 9)))
    ref = eqx.filter_jit(eqx.filter_grad(loss))(model, tokens)

    sharded = zoo.shard(model, mesh, fsdp=True, axis="fsdp")
    blocks = sharded.blocks
    assert blocks.qkv.weight.sharding.spec == P(None, "fsdp", "tensor")
    assert blocks.out.weight.sharding.spec == P(None, "tensor", "fsdp")
    assert blocks.mlp_in.weight.sharding.spec == P(None, "fsdp", "tensor")
    assert blocks.mlp_out.weight.sharding.spec == P(None, "tensor", "fsdp")
    assert sharded.head.weight.sharding.spec == P("fsdp", "tensor")  # by vocab
    if not llama:  # a column's bias is split with it, a row's is not
        assert blocks.qkv.bias.sharding.spec == P("fsdp", "tensor")
        assert "tensor" not in blocks.out.bias.sharding.spec
    assert "tensor" not in sharded.token_embedding.weight.sharding.spec

    @eqx.filter_jit
    def sharded_grad(m, b):
        return zoo.shard(eqx.filter_grad(loss)(m, b), mesh, fsdp=True, axis="fsdp")

    batch = zoo.shard_batch(tokens, mesh, axis=("data", "fsdp"))
    grads = sharded_grad(sharded, batch)
    check_allclose(f"tensor, llama={llama}", grads, ref)
    params = jax.tree.leaves(eqx.filter(sharded, eqx.is_array))
    for g, p in zip(jax.tree.leaves(grads), params, strict=True):
        assert g.sharding.is_equivalent_to(p.sharding, g.ndim), g.shape
    hlo = sharded_grad.lower(sharded, batch).compile().compiled.as_text()
    assert "all-gather" in hlo and "all-reduce" in hlo
    assert "all-to-all" not in hlo and "collective-permute" not in hlo


def test_tensor_parallel_errors():
    """What tensor parallelism cannot split is named: key/value heads or an
    MLP the tensor axis does not divide (when the model is called), a layer's
    axis (when placed), and FSDP over the tensor axis itself."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    tokens = jnp.zeros((2, 9), jnp.int32)
    # 2 key/value heads on 4 devices: whole heads cannot be split 4 ways.
    model = zoo.shard(zoo.Transformer.llama(32, 9, 16, 4, 1, num_kv_heads=2, d_ff=32,
                                            key=jr.key(0)), mesh)  # fmt: skip
    with pytest.raises(ValueError, match="expected num_kv_heads divisible by 4"):
        eqx.filter_jit(loss)(model, tokens)
    # An MLP of 6 hidden units: no 4-way split when placed.
    with pytest.raises(ValueError, match=r"tensor.*\(4 devices\).*shape \(1, 16, 6\)"):
        zoo.shard(zoo.Transformer(32, 9, 16, 4, 1, d_ff=6, key=jr.key(0)), mesh)
    with pytest.raises(ValueError, match="axis=.*leave out the mesh axis 'tensor'"):
        zoo.shard(jnp.ones((8, 8)), mesh, fsdp=True, axis=("data", "tensor"))
    with pytest.raises(ValueError, match="unknown parallel .heads.*columns"):
        zoo.Dense(4, 4, parallel="heads", key=jr.key(0))


@pytest.mark.slow
def test_explicit_mesh_gradients():
    """Under a mesh with Explicit axes (sharding in types, `jax.make_mesh`'s
    default): the Transformer (default and Llama blocks, tied embeddings; DP and
    FSDP) and the other zoo models (DP) give the single-device loss and gradients
    under `"dots"`, and `zoo.shard` inside jit reshards the gradients like the
    parameters."""
    assert jax.device_count() == DEVICES, jax.devices()
    mesh = jax.make_mesh(
        (DEVICES,),
        ("data",),
        axis_types=(AxisType.Explicit,),
    )
    assert mesh.axis_types == (AxisType.Explicit,)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 32, (DEVICES, 9)), dtype=jnp.int32)

    def mse(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    x = jnp.asarray(rng.normal(size=(DEVICES, 6)), dtype=jnp.float32)
    cases = [
        ("transformer", zoo.Transformer(32, 9, 16, 2, 2, key=jr.key(0)), loss, tokens),
        (
            "llama",
            zoo.Transformer.llama(32, 9, 16, 4, 2, tie_embeddings=True, key=jr.key(1)),
            loss,
            tokens,
        ),
        ("mlp", zoo.MLP(6, 6, 16, 3, key=jr.key(2)), mse, x),
        ("chain", zoo.ResidualChain(6, 4, key=jr.key(3)), mse, x),
    ]
    for name, model, fn, data in cases:
        ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(fn))(model, data)
        batch = zoo.shard_batch(data, mesh)
        assert batch.sharding.spec[0] == "data", (name, batch.sharding)
        for checkpoint in [
            "dots",
            eqx_remat.every(2),
            eqx_remat.recursive(),
            eqx_remat.binomial(2),
        ]:
            # FSDP on Explicit axes needs a model to gather each layer's weights
            # before use: the Transformer does; MLP and ResidualChain not yet.
            for fsdp in [False, True] if name in ("transformer", "llama") else [False]:
                label = f"explicit {name}, checkpoint={checkpoint!r}, fsdp={fsdp}"
                sharded = zoo.shard(
                    eqx_remat.set_checkpoint(model, checkpoint), mesh, fsdp=fsdp
                )

                @eqx.filter_jit
                def sharded_grad(m, b, fn=fn, fsdp=fsdp):
                    value, grads = eqx.filter_value_and_grad(fn)(m, b)
                    return value, zoo.shard(grads, mesh, fsdp=fsdp)

                value, grads = sharded_grad(sharded, batch)
                check_allclose(label, value, ref_loss)
                check_allclose(label, grads, ref_grads)
                params = jax.tree.leaves(eqx.filter(sharded, eqx.is_array))
                for g, p in zip(jax.tree.leaves(grads), params, strict=True):
                    assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (
                        label,
                        g.shape,
                    )


class _Tagged(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        h = jax.ad_checkpoint.checkpoint_name(x @ self.w, "h")
        return x + jnp.tanh(h)


@pytest.mark.heavy
def test_padded_segments_keep_memory_space_and_sharding():
    """A schedule whose split does not divide the depth skips the padded layers
    with a `lax.cond`, whose skip branch must return values of the exact types
    of the layers' (memory space of offloaded residuals, sharding under an
    Explicit mesh, weak type): every schedule, offloading inner policy and
    uneven depth gives the gradient of no checkpointing, with and without an
    Explicit mesh; and so does a 3-layer zoo Transformer under `every(2)`."""
    assert jax.device_count() == DEVICES, jax.devices()
    mesh = jax.make_mesh(
        (DEVICES,),
        ("data",),
        axis_types=(AxisType.Explicit,),
    )
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(DEVICES, 4)), dtype=jnp.float32)

    def stack_loss(layers, x, ck):
        return jnp.sum(eqx_remat.scan_layers(layers, x, checkpoint=ck) ** 2)

    grad = jax.jit(jax.grad(stack_loss), static_argnums=2)
    policies = [None, "offload_dots_no_batch", eqx_remat.offload_names("h")]
    schedules = [eqx_remat.recursive()] + [
        make(p)
        for p in policies
        for make in (
            lambda p: eqx_remat.every(2, policy=p),
            lambda p: eqx_remat.nested(2, policy=p),
            lambda p: eqx_remat.nested(3, policy=p),
            lambda p: eqx_remat.binomial(2, policy=p),
        )
    ]
    for depth in [3, 5]:
        w = rng.normal(size=(depth, 4, 4)).astype(np.float32) / 4
        layers = _Tagged(jnp.asarray(w))
        ref = grad(layers, x, None)
        for ck in schedules:
            check_allclose(f"depth {depth}, {ck!r}", grad(layers, x, ck), ref)
            with jax.set_mesh(mesh):
                batch = zoo.shard_batch(x, mesh)
                label = f"explicit mesh, depth {depth}, {ck!r}"
                check_allclose(label, grad(layers, batch, ck), ref)

    tokens = jnp.asarray(rng.integers(0, 32, (DEVICES, 9)), dtype=jnp.int32)
    model = zoo.Transformer(32, 9, 16, 2, 3, key=jr.key(4))
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, tokens)
    for ck in [eqx_remat.every(2), eqx_remat.every(2, "offload_dots_no_batch")]:
        label = f"explicit transformer, checkpoint={ck!r}"
        with jax.set_mesh(mesh):
            sharded = zoo.shard(eqx_remat.set_checkpoint(model, ck), mesh)
            batch = zoo.shard_batch(tokens, mesh)
            value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(
                sharded, batch
            )
        check_allclose(label, value, ref_loss)
        check_allclose(label, grads, ref_grads)


def _shard_map_specs(jaxpr) -> list:
    """The `in_specs` of every `shard_map` in `jaxpr`, sub-jaxprs included."""
    specs = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            specs.append(eqn.params["in_specs"])
        for v in eqn.params.values():
            for sub in v if isinstance(v, tuple | list) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    specs += _shard_map_specs(sub)
    return specs


@pytest.mark.heavy
def test_flash_attention_stays_per_device_under_every_schedule():
    """`jax.vmap(model, spmd_axis_name="data")` keeps flash attention per
    device under every depth schedule: the `shard_map` around the kernel in the
    traced gradient splits the batch over 'data' (the schedules' `custom_vmap`
    rule batches with the axis name), as without a schedule."""
    import jax.experimental.pallas.tpu as pltpu

    assert jax.device_count() == DEVICES, jax.devices()
    mesh = jax.make_mesh(
        (DEVICES,),
        ("data",),
        axis_types=(AxisType.Auto,),
    )
    model = zoo.Transformer.llama(16, 8, 8, 2, 1, attention="flash", key=jr.key(0))
    tokens = zoo.shard_batch(jnp.zeros((DEVICES, 8), jnp.int32), mesh)

    def loss(model, tokens):
        return jnp.sum(jax.vmap(model, spmd_axis_name="data")(tokens))

    schedules = [None, "dots", eqx_remat.recursive(), eqx_remat.every(1)]
    schedules += [eqx_remat.every(2, "dots"), eqx_remat.nested(2)]
    schedules += [eqx_remat.binomial(1), eqx_remat.binomial(2, "dots")]
    for ck in schedules:
        grad = eqx.filter_grad(loss)
        with pltpu.force_tpu_interpret_mode(True), jax.set_mesh(mesh):
            jaxpr = eqx.filter_make_jaxpr(grad)(
                eqx_remat.set_checkpoint(model, ck), tokens
            )[0]
        # The forward kernel (q, k, v) and the backward one (and its residuals):
        # the kernel's operands are split over 'data'.
        kernels = [s for s in _shard_map_specs(jaxpr.jaxpr) if len(s) >= 3]
        assert len(kernels) >= 2, (ck, kernels)
        for specs in kernels:
            assert all(spec == P("data") for spec in specs[:3]), (ck, specs)
    # Under tensor parallelism, each device's kernel runs on its heads too.
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    model = zoo.Transformer.llama(
        16, 8, 8, 2, 1, num_kv_heads=2, attention="flash", key=jr.key(0)
    )
    model = zoo.shard(model, mesh)
    tokens = zoo.shard_batch(jnp.zeros((DEVICES, 8), jnp.int32), mesh)
    for ck in [None, "dots"]:
        with pltpu.force_tpu_interpret_mode(True), jax.set_mesh(mesh):
            jaxpr = eqx.filter_make_jaxpr(eqx.filter_grad(loss))(
                eqx_remat.set_checkpoint(model, ck), tokens
            )[0]
        kernels = [s for s in _shard_map_specs(jaxpr.jaxpr) if len(s) >= 3]
        assert len(kernels) >= 2, (ck, kernels)
        for specs in kernels:
            heads = P("data", None, "tensor")
            assert all(spec == heads for spec in specs[:3]), (ck, specs)


@pytest.mark.slow
def test_sharded_training():
    """benchmarks/train_lm.py --mesh: FSDP training follows the single-device loss
    curve, and its checkpoint resumes data parallel."""
    import tempfile

    from benchmarks import train as train_lm

    tiny = [
        "--steps", "3", "--batch", "8", "--seq", "16", "--d-model", "16",
        "--heads", "2", "--layers", "2", "--warmup", "1", "--data-bytes", "100000",
        "--eval-batches", "0", "--no-progress", "--remat", "every:1:dots",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        single = train_lm.main([*tiny, "--mesh", "none", "--save-dir", out])
    with tempfile.TemporaryDirectory() as ckpt_dir:
        fsdp = train_lm.main(
            [*tiny, "--mesh", "fsdp:8", "--save-dir", ckpt_dir, "--stop-after", "2"]
        )
        dp = train_lm.main(
            [*tiny, "--mesh", "dp:8", "--save-dir", ckpt_dir, "--resume"]
        )
    np.testing.assert_allclose(
        fsdp.losses + dp.losses, single.losses, rtol=RTOL, atol=0
    )
    # Adam divides by the root of the second moment: where a gradient is near zero
    # its update is near-sign-like and a 1e-6 relative difference in the gradient
    # moves it by up to a few percent of the learning rate (seen: 7e-5 at lr 3e-3).
    lr = train_lm.RunConfig().lr
    for a, b in zip(
        jax.tree.leaves(eqx.filter(dp.state.model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(single.state.model, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=0.1 * lr)


@pytest.mark.heavy
def test_fsdp_gathers_one_layer_of_weights_not_the_activations():
    """FSDP on Auto mesh axes gathers weights, one layer at a time, never
    activations: every all-gather of the compiled gradient step (a bf16 Llama,
    4 layers, `"nothing"`) has the shape of one layer's weight (f32 or bf16:
    the CPU gathers before it casts, a TPU after) or of a weight outside the
    stack, and every matrix of a layer is gathered. Without the block's
    sharding constraint, XLA kept the MLP's weights split and gathered the
    layer input over the whole batch (on 256 TPU v5e chips, for MaxText's 16B
    model: 24 GiB a chip)."""
    assert jax.device_count() == DEVICES, jax.devices()
    mesh = jax.make_mesh(
        (DEVICES,),
        ("data",),
        axis_types=(AxisType.Auto,),
    )
    layers, batch, seq = 4, 24, 64
    model = eqx.filter_eval_shape(
        lambda: zoo.Transformer.llama(
            256,
            seq,
            256,
            8,
            layers,
            d_ff=1024,
            attention="xla",
            dtype=jnp.bfloat16,
            checkpoint="nothing",
            key=jr.key(0),
        )
    )
    model = zoo.shard(model, mesh, fsdp=True)
    tokens = zoo.shard_batch(jax.ShapeDtypeStruct((batch, seq), jnp.int32), mesh)
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    params, static = eqx.partition(model, is_abstract, is_leaf=is_abstract)

    def step(params, tokens):
        grads = eqx.filter_grad(loss)(eqx.combine(params, static), tokens)
        return zoo.shard(grads, mesh, fsdp=True)

    hlo = jax.jit(step).lower(params, tokens).compile().as_text()
    gathered = set(re.findall(r"= (\w+\[[\d,]*\])\S* all-gather\(", hlo))

    def name(dtype, shape):
        return f"{jnp.dtype(dtype).name}[{','.join(map(str, shape))}]".replace(
            "float32", "f32"
        ).replace("bfloat16", "bf16")

    # One layer's slice of the stack, with or without its leading axis.
    stack = jax.tree.leaves(params.blocks, is_leaf=is_abstract)
    outside = eqx.tree_at(lambda m: m.blocks, params, None)
    shapes = [s for x in stack for s in ((1, *x.shape[1:]), x.shape[1:])]
    shapes += [x.shape for x in jax.tree.leaves(outside, is_leaf=is_abstract)]
    allowed = {name(d, s) for s in shapes for d in (jnp.float32, jnp.bfloat16)}
    assert gathered <= allowed, (sorted(gathered - allowed), sorted(allowed))
    for x in stack:
        if x.ndim == 3:
            layer = {
                name(d, s)
                for s in ((1, *x.shape[1:]), x.shape[1:])
                for d in (jnp.float32, jnp.bfloat16)
            }
            assert layer & gathered, (x.shape, sorted(gathered))


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

"""eqx_remat.accumulate: micro-batches give the full batch's results in about
1/k of the activation memory, under jit, vmap and shardings."""

import contextlib

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import check_close, raises_bad_input
from hypothesis import given
from jax.sharding import AxisType

import eqx_remat
import zoo
from eqx_remat._inspect._jaxpr import scan_sizes


# f32: k micro-batches sum the batch in another order (k partial means). Seen:
# max relative difference ~2e-7.
def mlp_loss(model, x, y, *, scale=1.0):
    """Mean squared error of a batch (`x`, `y` batched along axis 0), with aux:
    an integer count and a float mean."""
    pred = jax.vmap(model)(x)
    aux = {"positive": jnp.sum(x > 0), "mean": jnp.mean(pred)}
    return scale * jnp.mean((pred - y) ** 2), aux


def mlp_batch(batch, key=0):
    kx, ky = jr.split(jr.key(key))
    return jr.normal(kx, (batch, 3)), jr.normal(ky, (batch, 2))


MLP = zoo.MLP(3, 2, 8, 2, key=jr.key(0))
GRAD = eqx.filter_value_and_grad(mlp_loss, has_aux=True)


@pytest.mark.heavy
@given(
    k=st.integers(1, 4),
    per_micro=st.integers(1, 3),
    reduce=st.sampled_from(["mean", "sum"]),
)
def test_equals_the_full_batch(k, per_micro, reduce):
    """For any micro-batch count and size: the loss, the aux (a mean and an
    integer count) and the gradients of the full batch; `"sum"` is `k` times
    `"mean"` for floats, and counts are summed under both."""
    x, y = mlp_batch(k * per_micro)
    ref = eqx.filter_jit(GRAD)(MLP, x, y)
    step = eqx_remat.accumulate(GRAD, k, in_axes=(None, 0, 0), reduce=reduce)
    out = eqx.filter_jit(step)(MLP, x, y)
    if reduce == "sum":
        (loss, aux), grads = out
        out = (
            (loss / k, {"mean": aux["mean"] / k, "positive": aux["positive"]}),
            jax.tree.map(lambda g: g / k, grads),
        )
    check_close(out, ref)


def test_batch_axis_other_than_the_first_and_keyword_arguments():
    """`in_axes` as in `jax.vmap`: an axis per argument, a pytree prefix, a
    negative axis; keyword arguments reach every micro-batch unchanged."""
    x, y = mlp_batch(6)

    def loss(model, batch, *, scale):
        return mlp_loss(model, batch["x"].T, batch["y"], scale=scale)

    grad = eqx.filter_value_and_grad(loss, has_aux=True)
    batch = {"x": x.T, "y": y}
    ref = grad(MLP, batch, scale=2.0)
    step = eqx_remat.accumulate(grad, 3, in_axes=(None, {"x": -1, "y": 0}))
    check_close(step(MLP, batch, scale=2.0), ref)
    # A dict prefix is hashable: the step can be jitted as it is.
    check_close(eqx.filter_jit(step)(MLP, batch, scale=2.0), ref)


def test_jit_vmap_and_non_array_outputs():
    """Under `jax.vmap` (an ensemble of batches), and with `None` gradients of
    non-array leaves and a Python value in the output, as `eqx.filter_grad`
    returns them."""
    (x0, y0), (x1, y1) = mlp_batch(6, 0), mlp_batch(6, 1)
    xs, ys = jnp.stack([x0, x1]), jnp.stack([y0, y1])

    def loss(model, x, y):
        return mlp_loss(model, x, y)[0], "note"

    grad = eqx.filter_value_and_grad(loss, has_aux=True)
    params, static = eqx.partition(MLP, eqx.is_array)

    def per_batch(fn):
        def f(x, y):
            (value, note), grads = fn(eqx.combine(params, static), x, y)
            assert note == "note"
            return value, grads

        return eqx.filter_jit(jax.vmap(f))

    ref = per_batch(grad)(xs, ys)
    out = per_batch(eqx_remat.accumulate(grad, 2, in_axes=(None, 0, 0)))(xs, ys)
    check_close(out, ref)
    (_, note), _ = eqx_remat.accumulate(grad, 2, in_axes=(None, 0, 0))(
        MLP, xs[0], ys[0]
    )
    assert note == "note"


def test_dropout_keys_and_a_transformer():
    """A zoo Transformer with dropout, one key per sequence split with the
    sequences: the gradients of the full batch."""
    model = zoo.Transformer(
        16, 6, 8, 2, 2, dropout=0.1, checkpoint="dots", key=jr.key(0)
    )
    tokens = jr.randint(jr.key(1), (4, 6), 0, 16)
    keys = jr.split(jr.key(2), 4)

    def loss(model, tokens, keys):
        logits = jax.vmap(lambda t, k: model(t[:-1], key=k))(tokens, keys)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    grad = eqx.filter_value_and_grad(loss)
    ref = eqx.filter_jit(grad)(model, tokens, keys)
    step = eqx_remat.accumulate(grad, 2, in_axes=(None, 0, 0))
    check_close(eqx.filter_jit(step)(model, tokens, keys), ref)


def test_bf16_outputs_accumulate_in_f32():
    """bf16 gradients are summed in float32 and returned in bfloat16."""
    w = jnp.ones((3,), jnp.bfloat16)
    x = jr.normal(jr.key(0), (64, 3)).astype(jnp.bfloat16)
    grad = jax.value_and_grad(lambda w, x: jnp.mean(jnp.sin(x @ w)))
    value, g = eqx_remat.accumulate(grad, 8)(w, x)
    assert value.dtype == g.dtype == jnp.bfloat16
    ref_value, ref_g = jax.value_and_grad(
        lambda w, x: jnp.mean(jnp.sin(x @ w)), argnums=0
    )(w.astype(jnp.float32), x.astype(jnp.float32))
    # bf16 has 8 bits of mantissa: each micro-batch's gradient is rounded.
    np.testing.assert_allclose(np.float32(value), ref_value, rtol=0, atol=2e-3)
    np.testing.assert_allclose(np.float32(g), ref_g, rtol=0, atol=2e-3)
    jaxpr = jax.make_jaxpr(eqx_remat.accumulate(grad, 8))(w, x).jaxpr
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    first, n_carry = scan_sizes(scan)  # jax 0.11 has no `num_consts` parameter
    carry = scan.params["jaxpr"].in_avals[first : first + n_carry]
    assert [a.dtype for a in carry] == [jnp.float32, jnp.float32]


def test_one_micro_batch_is_grad_fn_itself():
    x, y = mlp_batch(4)
    params, static = eqx.partition(MLP, eqx.is_array)
    step = eqx_remat.accumulate(GRAD, 1)

    def jaxpr(fn):
        return str(jax.make_jaxpr(lambda p: fn(eqx.combine(p, static), x, y))(params))

    assert jaxpr(step) == jaxpr(GRAD)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_activation_memory_falls_as_one_over_k(k):
    """An activation-dominated MLP step (batch 256, width 64): compiled temp
    memory within `1/k` of the full batch's plus two gradient-sized buffers (the
    accumulator and one micro-batch's gradients)."""
    model = eqx.filter_eval_shape(lambda: zoo.MLP(32, 32, 64, 4, key=jr.key(0)))
    x = jax.ShapeDtypeStruct((256, 32), jnp.float32)

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    grad = eqx.filter_value_and_grad(loss)
    full = eqx_remat.memory_report(grad, model, x)
    micro = eqx_remat.memory_report(eqx_remat.accumulate(grad, k), model, x)
    # Seen: 1917208 B at k=1; 1091128 (k=2), 599864 (k=4), 357944 (k=8).
    assert micro.temp_bytes <= full.temp_bytes / k + 2 * full.output_bytes
    assert micro.output_bytes == full.output_bytes


def test_errors_name_the_argument():
    x, y = mlp_batch(6)
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
        eqx_remat.accumulate(GRAD, 0)
    with raises_bad_input(r"reduce must be one of \['mean', 'sum'\]", param="reduce"):
        eqx_remat.accumulate(GRAD, 2, reduce="max")  # pyright: ignore[reportArgumentType]
    step = eqx_remat.accumulate(GRAD, 4, in_axes=(None, 0, 0))
    with pytest.raises(
        ValueError,
        match=r"micro_batches=4 must divide the batch size\. Got a batch of 6 "
        r"\(axis 0 of shape \(6, 3\) at args\[1\]\)",
    ):
        step(MLP, x, y)
    with pytest.raises(ValueError, match="in_axes must have one entry per positional"):
        eqx_remat.accumulate(GRAD, 2)(MLP, x, y)
    with pytest.raises(ValueError, match=r"same batch size\. Got 6 at args\[1\]"):
        eqx_remat.accumulate(GRAD, 2, in_axes=(None, 0, 0))(MLP, x, y[:4])
    with pytest.raises(ValueError, match="splits no array"):
        eqx_remat.accumulate(GRAD, 2, in_axes=None)(MLP, x, y)
    with pytest.raises(ValueError, match="gives axis 2 for the array of shape"):
        eqx_remat.accumulate(GRAD, 2, in_axes=(None, 2, 0))(MLP, x, y)
    # Not ints: a float, a string, a bool (an int to Python, read as axis 1).
    for bad in (0.0, "0", True):
        with pytest.raises(ValueError, match=r"in_axes\[1\] must be an int, None or"):
            eqx_remat.accumulate(GRAD, 2, in_axes=(None, bad, 0))(MLP, x, y)


def _lm_loss(model, tokens):
    return jax.vmap(model.loss)(tokens[:, :-1], tokens[:, 1:]).mean()


@pytest.mark.heavy
@pytest.mark.parametrize(
    "axis_type, fsdp, chunk",
    [
        (AxisType.Auto, False, None),
        (AxisType.Auto, True, None),
        (AxisType.Auto, True, 3),
        (AxisType.Explicit, False, 3),
        (AxisType.Explicit, True, None),
    ],
)
def test_sharded_data_parallel_and_fsdp_stay_local(axis_type, fsdp, chunk):
    """On the 8 CPU devices of this process, a Transformer's accumulated
    gradients under data parallelism and FSDP, on Auto and Explicit mesh axes,
    with the whole and the chunked loss head (3 positions a chunk), equal one
    device's, and the compiled step (Auto axes) moves no example between
    devices (no all-to-all or collective-permute; under data parallelism no
    all-gather: a contiguous split, `(k, B/k)`, all-gathers the batch)."""
    devices = 8
    assert jax.device_count() == devices, jax.devices()
    model = zoo.Transformer(32, 8, 16, 2, 2, checkpoint="dots", key=jr.key(0))
    # 32 sequences: 4 per device, 2 micro-batches of 2 on each.
    tokens = jr.randint(jr.key(1), (32, 8), 0, 32)
    grad = eqx.filter_value_and_grad(_lm_loss)
    ref = eqx.filter_jit(grad)(model, tokens)
    m = model if chunk is None else zoo.set_loss_chunk_size(model, chunk)
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(axis_type,))
    params, static = eqx.partition(zoo.shard(m, mesh, fsdp=fsdp), eqx.is_array)
    batch = zoo.shard_batch(tokens, mesh)
    accumulated = eqx_remat.accumulate(grad, 2)
    step = jax.jit(lambda p, b: accumulated(eqx.combine(p, static), b))
    # Explicit axes are traced under their mesh (`jax.set_mesh`), as JAX's
    # sharding guide writes them: with jax 0.12.1, the chunked head's
    # `jax.checkpoint` in a `lax.scan` transposes to a dot over the batch that
    # is ambiguous without it ("Contracting dimensions are sharded"; jax 0.10.2
    # traced it either way).
    explicit = axis_type == AxisType.Explicit
    with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
        out = step(params, batch)
    # f32: the sharded, accumulated program sums in another order. Seen: ~1e-7.
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if axis_type == AxisType.Explicit:
        return
    hlo = step.lower(params, batch).compile().as_text()
    for op in ("all-to-all", "collective-permute"):
        assert op not in hlo, op
    if not fsdp:
        assert "all-gather" not in hlo, "gathered an array"
        assert "all-reduce" in hlo

"""JAX's remat3 (`jax_remat3=True`): every checkpoint gives the same gradients,
saves the same residuals and counts the same FLOPs as without it.

JAX's remat3 checkpoints with another machinery than the checkpoint before it:
a higher-order operation (`RematTraced`) that recomputes its jaxpr inside the
backward pass, tags as higher-order operations too. eqx_remat's policies,
schedules and inspection read both. jax 0.12's remat3 asks any policy at each
operation it can save; jax 0.10.2's honours only JAX's own policy values, by
their type, and cannot vmap a tag: there, what it cannot do is asserted to fail
clearly instead.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from helpers import jax_remat3
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import eqx_remat as er
import zoo
from eqx_remat._inspect._jaxpr import eval_jaxpr, hi_operation, tag_name
from eqx_remat._policies._apply import checkpointed


# jax 0.12's remat3 calls a policy at each matrix product and tag; jax 0.10.2's
# looks only at the type of JAX's own policy values, so it would recompute what
# an offloading policy (a function) offloads: eqx_remat refuses those there.
ASKS_ANY_POLICY = jax.__version_info__ >= (0, 12)


class _Layer(eqx.Module):
    """A tiny layer with a matrix product, two tags and transcendentals."""

    w: jax.Array

    def __call__(self, x):
        h = checkpoint_name(x @ self.w, "h")
        return jnp.tanh(checkpoint_name(jnp.sin(h) * 2.0, "s"))


DEPTH = 4
_layers = er.stack(
    lambda k: _Layer(jr.normal(k, (8, 8)) / 3), jr.split(jr.key(0), DEPTH)
)
_x = jnp.linspace(-1.0, 1.0, 24).reshape(3, 8)


def _loss(layers, x, ck):
    return jnp.sum(er.scan_layers(layers, x, checkpoint=ck) ** 2)


CHECKPOINTS = {
    "nothing": "nothing",
    "everything": "everything",
    "dots": "dots",
    "dots_no_batch": "dots_no_batch",
    "offload_dots_no_batch": "offload_dots_no_batch",
    "save_names": er.save_names("h"),
    "save_all_but_names": er.save_all_but_names("s"),
    "offload_names": er.offload_names("h"),
    "save_and_offload_names": er.save_and_offload_names(save="h", offload="s"),
    "every": er.every(2, policy="dots"),
    "nested": er.nested(2, policy=er.save_names("s")),
    "recursive": er.recursive(),
    "binomial": er.binomial(2, policy=er.save_all_but_names("s")),
    "ranges": er.ranges(
        (1, "nothing"),
        (2, er.every(1, policy=er.save_names("h"))),
        (1, er.offload_names("s")),
    ),
    "ranges_save_all_but_names": er.ranges(
        (1, "nothing"), (3, er.save_all_but_names("h"))
    ),
}
# Those that offload (in a range, too): refused by jax 0.10.2's remat3.
OFFLOADING = {
    "offload_dots_no_batch",
    "offload_names",
    "save_and_offload_names",
    "ranges",
}


def _measure(ck):
    grad = jax.grad(_loss)
    g = grad(_layers, _x, ck)
    res = er.residuals(_loss, _layers, _x, ck)
    flops = er.count_flops(grad, _layers, _x, ck)
    return g, sorted((r.shape, str(r.dtype), r.name or "") for r in res), flops


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_remat3_same_gradients_residuals_and_flops(name):
    ck = CHECKPOINTS[name]
    with jax_remat3(False):
        g, res, flops = _measure(ck)
    assert flops.unknown == {}
    with jax_remat3(True):
        if name in OFFLOADING and not ASKS_ANY_POLICY:
            with pytest.raises(
                NotImplementedError,
                match=r"is not supported under JAX's remat3 \(jax_remat3=True\) in "
                rf"jax {re.escape(jax.__version__)}",
            ):
                jax.grad(_loss)(_layers, _x, ck)
            return
        g3, res3, flops3 = _measure(ck)
    assert jnp.allclose(g3.w, g.w, rtol=1e-5, atol=1e-6)
    # The same values saved: shapes, dtypes and tags (so the same bytes).
    assert res3 == res
    assert (int(flops3), flops3.transcendentals) == (int(flops), flops.transcendentals)
    assert flops3.dot_bytes == flops.dot_bytes and flops3.unknown == {}


@pytest.mark.parametrize("traced_on", [False, True], ids=["traced", "traced_remat3"])
def test_remat3_tags_take_the_form_in_force_and_save_all_but_names_sees_them(
    traced_on,
):
    """A layer traced once (as the engine traces each stack's layer) and
    evaluated again binds its tags as the checkpoint in force takes them. The
    exact `save_all_but_names` checkpoints with remat3 off: a layer traced
    with remat3 on must still show it its tags, or its pullback keeps the
    `cos` of the excluded `h` (as `ranges` once did, one value per layer)."""
    w = _layers.w[0]
    with jax_remat3(traced_on):
        closed = jax.make_jaxpr(lambda w, x: _Layer(w)(x))(w, _x)

    def layer(w, x):
        return eval_jaxpr(closed.jaxpr, closed.consts, [w, x])[0]

    def forms(on):
        with jax_remat3(on):
            again = jax.make_jaxpr(layer)(w, _x).jaxpr
        return {
            type(hi_operation(e)).__name__ if hi_operation(e) else e.primitive.name
            for e in again.eqns
            if tag_name(e) is not None
        }

    assert forms(False) == {"name"} and forms(True) == {"CheckpointName"}

    def saved(fn, on):
        with jax_remat3(on):
            res = er.residuals(checkpointed(fn, er.save_all_but_names("h")), w, _x)
        return [(r.shape, str(r.dtype)) for r in res], [r.source for r in res]

    expected, sources = saved(lambda w, x: _Layer(w)(x), False)
    got, sources3 = saved(layer, True)
    # `h` excluded: nothing computed from it but for the output's derivative.
    assert not any("of cos" in s or "of sin" in s for s in sources + sources3)
    assert got == expected


def test_remat3_recomputation_is_counted_and_xla_agrees():
    """A checkpointed gradient without loops: remat3's recomputation (a
    higher-order operation in the backward pass) is counted, as XLA counts it,
    and is the forward pass once more."""
    w = jnp.ones((64, 64)) / 64

    def f(x):
        for _ in range(3):
            x = jnp.tanh(x @ w)
        return x

    def loss(x):
        return jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)(
            x
        ).sum()

    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    counts = {}
    for on in (False, True):
        with jax_remat3(on):
            # `jax.grad`: the forward pass is dead code, dropped by both, so
            # XLA cannot merge the recomputation with it (jaxlib 0.10.2 does,
            # despite the optimisation barrier, when the forward pass is live).
            xla = jax.jit(jax.grad(loss)).lower(x).compile().cost_analysis()
            # Within 1%, as for every loop-free function (test_inspect.py):
            # jaxlib 0.10.2 simplifies one elementwise operation more; the
            # recomputation not counted would be a third of the total.
            ours = int(er.count_flops(jax.grad(loss), x))
            assert abs(ours - xla["flops"]) < 0.01 * xla["flops"]
            counts[on] = er.count_flops(jax.value_and_grad(loss), x)
            assert counts[on].unknown == {}
    assert int(counts[True]) == int(counts[False])
    # Against no checkpoint: the 3 products and 3 tanh once more.
    plain = er.count_flops(jax.value_and_grad(lambda x: f(x).sum()), x)
    assert int(counts[True]) - int(plain) == 3 * (2 * 32 * 64 * 64)
    assert counts[True].transcendentals - plain.transcendentals == 3 * 32 * 64


def test_remat3_scan_of_checkpoints_counts_every_iteration():
    """remat3's checkpoint inside a `lax.scan`: its recomputation counts once
    per iteration."""
    ws = jnp.ones((5, 16, 16)) / 16

    def loss(ws, x):
        body = jax.checkpoint(lambda c, w: (jnp.sin(c @ w), None))
        return lax.scan(body, x, ws)[0].sum()

    x = jnp.ones((4, 16))
    counts = {}
    for on in (False, True):
        with jax_remat3(on):
            counts[on] = er.count_flops(jax.grad(loss), ws, x)
    assert int(counts[True]) == int(counts[False]) and counts[True].unknown == {}
    with jax_remat3(True):
        plain = er.count_flops(
            jax.grad(
                lambda ws, x: lax.scan(lambda c, w: (jnp.sin(c @ w), None), x, ws)[
                    0
                ].sum()
            ),
            ws,
            x,
        )
    # Each of the 5 layers recomputes its product (4 × 16 × 16) once more.
    assert int(counts[True]) - int(plain) >= 5 * 2 * 4 * 16 * 16


_TRANSFORMER_CHECKPOINTS = {
    "nothing": "nothing",
    "dots": "dots",
    "dots_no_batch": "dots_no_batch",
    "save_names": er.save_names("qkv_proj"),
    "ranges": er.ranges((1, "nothing"), (2, er.every(1, policy="dots"))),
}


@pytest.mark.parametrize(
    "name", list(_TRANSFORMER_CHECKPOINTS), ids=list(_TRANSFORMER_CHECKPOINTS)
)
def test_remat3_transformer_counts_and_saves_alike(name):
    """The issue's case: zoo.Transformer(64, 32, 32, 2, 3), batch 2, counted
    fewer FLOPs under remat3 than without (for 'nothing', fewer than no
    checkpoint). jax 0.10.2's remat3 cannot vmap a tag (the zoo vmaps its
    examples): there, that JAX error is asserted."""
    model = zoo.Transformer(
        64, 32, 32, 2, 3, checkpoint=_TRANSFORMER_CHECKPOINTS[name], key=jr.key(0)
    )
    tokens = jr.randint(jr.key(1), (2, 32), 0, 64)

    def loss(model, tokens):
        return jnp.mean(jax.vmap(model)(tokens) ** 2)

    grad = eqx.filter_grad(loss)

    def measure():
        res = sorted((r.shape, r.name or "") for r in er.residuals(loss, model, tokens))
        return er.count_flops(grad, model, tokens), res

    with jax_remat3(False):
        flops, res = measure()
        none = er.count_flops(grad, er.set_checkpoint(model, None), tokens)
    with jax_remat3(True):
        if not ASKS_ANY_POLICY:
            with pytest.raises(NotImplementedError, match="for vmap support"):
                measure()
            return
        flops3, res3 = measure()
    assert (int(flops3), flops3.transcendentals) == (int(flops), flops.transcendentals)
    assert res3 == res
    assert int(flops3) > int(none)  # a checkpoint recomputes something

import math
from typing import Any

import equinox as eqx
import equinox.internal as eqxi
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_primitive, raises_bad_input, temp_bytes
from hypothesis import given

import eqx_remat as er


class Layer(eqx.Module):
    w: jax.Array
    b: jax.Array

    def __call__(self, x, t=None):
        y = x + jnp.tanh(x @ self.w + jnp.broadcast_to(self.b, x.shape))
        return y if t is None else y * t


def make_layers(depth, width, key=jax.random.key(0)):
    def make(k):
        kw, kb = jax.random.split(k)
        return Layer(
            jax.random.normal(kw, (width, width)) / (2 * math.sqrt(width)),
            jax.random.normal(kb, (width,)) / 10,
        )

    return er.stack(make, jax.random.split(key, depth))


SCHEDULES = [
    None,
    "nothing",
    "dots",
    "everything",
    "dots_no_batch",
    # A name policy of JAX (not checked against the tags): saves nothing here.
    jax.checkpoint_policies.save_only_these_names("never_tagged"),
    er.every(1),
    er.every(3),
    er.every(5, policy="nothing"),
    er.every(64),
    er.nested(1),
    er.nested(2),
    er.nested(2, policy="dots"),
    er.nested(3),
    er.nested(4, policy="nothing"),
    er.recursive(),
]


def _loss(layers, x, ts, ck):
    return jnp.sum(er.scan_layers(layers, x, ts, checkpoint=ck) ** 2)


_grad = jax.jit(jax.grad(_loss, argnums=(0, 1)), static_argnums=3)
_value = jax.jit(_loss, static_argnums=3)


@pytest.mark.heavy
@given(
    depth=st.integers(1, 64),
    width=st.sampled_from([2, 5]),
    batch=st.integers(1, 3),
    ck=st.sampled_from(SCHEDULES[1:]),
    with_xs=st.booleans(),
)
def test_scan_layers_gradients(depth, width, batch, ck, with_xs):
    layers = make_layers(depth, width)
    x = jax.random.normal(jax.random.key(1), (batch, width))
    ts = jnp.linspace(0.9, 1.1, depth) if with_xs else None
    assert jnp.allclose(_value(layers, x, ts, ck), _value(layers, x, ts, None), 1e-5)
    assert eqx.tree_equal(
        _grad(layers, x, ts, ck), _grad(layers, x, ts, None), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("depth", [1, 7], ids=lambda d: f"D{d}")
@pytest.mark.parametrize(
    "ck", ["dots", er.every(3), er.nested(2), er.recursive()], ids=str
)
def test_chain_gradients(depth, ck):
    def loss(x, w, ck):
        # Distinct callables: a function, a closure over an array that is
        # differentiated, and a module.
        fns = [jnp.sin, lambda x: x * w + 1.0, eqx.nn.Lambda(jnp.tanh)]
        fns = [fns[i % 3] for i in range(depth)]
        return jnp.sum(er.chain(fns, checkpoint=ck)(x) ** 2)

    x = jnp.array([0.3, -0.2, 0.5])
    w = jnp.array([0.5, 0.9, -0.4])
    g = jax.grad(loss, argnums=(0, 1))(x, w, ck)
    g_ref = jax.grad(loss, argnums=(0, 1))(x, w, None)
    assert eqx.tree_equal(g, g_ref, rtol=1e-5, atol=1e-6)


class _Noisy(eqx.Module):
    w: jax.Array

    def __call__(self, c):
        h, key = c
        key, sub = jax.random.split(key)
        return jnp.tanh(self.w * h) * jax.random.uniform(sub), key


@pytest.mark.parametrize(
    "ck",
    [er.every(2, "nothing"), er.nested(3, "dots"), er.ranges((3, er.every(2, "dots")))],
    ids=str,
)
def test_a_key_in_the_carry_under_a_padded_schedule_with_a_policy(ck):
    # Three layers split by two: the padded layer's branch returns zeros of
    # each residual's type, a key's included (it returned the key's tangent
    # type, and lax.cond refused the branches).
    w = jnp.array([0.5, 0.7, 0.9])

    def loss(w, ck):
        carry = (jnp.float32(0.3), jax.random.key(0))
        return er.scan_layers(_Noisy(w), carry, checkpoint=ck)[0]

    want = jax.grad(loss)(w, None)
    assert eqx.tree_equal(jax.grad(loss)(w, ck), want, rtol=1e-5, atol=1e-6)


class _Scale(eqx.Module):
    s: Any

    def __call__(self, x):
        return jnp.sin(self.s * x)


@pytest.mark.parametrize(
    "ck",
    [er.every(2), er.recursive(), er.binomial(1), er.ranges((1, "dots"), (2, None))],
    ids=str,
)
def test_chain_differentiates_a_python_float_it_closes_over(ck):
    # `jax.grad` of a Python float traces it, and a custom_vjp then sees a
    # float: its gradient must still flow (it was 0 under every schedule).
    x = jnp.array([0.3, -0.2, 0.5])

    def loss(s, ck):
        closures = [lambda v: jnp.sin(s * v), lambda v: v * v, lambda v: s + v]
        modules = [_Scale(s), jnp.cos, _Scale(2 * s)]
        return sum(jnp.sum(er.chain(f, checkpoint=ck)(x)) for f in (closures, modules))

    want = float(jax.grad(loss)(1.3, None))
    assert abs(want) > 0.1
    assert float(jax.grad(loss)(1.3, ck)) == pytest.approx(want, rel=1e-5)


class _Apply(eqx.Module):
    w: jax.Array
    f: Any = eqx.field(static=True)

    def __call__(self, c):
        return self.f(self.w, c)


@pytest.mark.parametrize(
    "ck",
    [
        er.every(2),
        er.nested(2, "dots"),
        er.binomial(1),
        er.ranges((1, "dots"), (2, None)),
    ],
    ids=str,
)
def test_layers_may_close_over_values_jax_traces(ck):
    # A custom_vjp must not close over a tracer. Under every schedule, layers
    # whose calls read a value traced by `jax.grad` (a float) or `jax.vmap` (an
    # integer), not held in their fields, failed with UnexpectedTracerError or
    # an assertion.
    x = jnp.array([0.3, -0.2])
    w = jnp.array([[0.5, 1.0], [0.7, -0.4], [0.9, 0.2]])

    def loss(s, n, ck):
        m = lambda v: jnp.asarray(n, v.dtype)  # the integer, read in the layer
        layers = _Apply(w, lambda w, c: jnp.sin(w * c * s) + m(c))
        fns = [lambda v: v * m(v), lambda v: jnp.sin(s * v), jnp.cos]
        return jnp.sum(er.scan_layers(layers, x, checkpoint=ck)) + jnp.sum(
            er.chain(fns, checkpoint=ck)(x)
        )

    grad = jax.grad(loss)
    want = grad(1.3, 2, None)
    assert abs(float(want)) > 0.1
    assert float(grad(1.3, 2, ck)) == pytest.approx(float(want), rel=1e-5)
    ns = jnp.arange(3)
    batched = jax.vmap(grad, (None, 0, None))
    assert eqx.tree_equal(
        batched(1.3, ns, ck), batched(1.3, ns, None), rtol=1e-5, atol=1e-6
    )


def test_a_schedule_runs_outside_jit_under_an_explicit_mesh():
    # Outside jax.jit, a layer sliced from arrays made before the mesh carries
    # its sharding and the layer inside the scan none: the layer traced once
    # to hoist what it closes over must not be checked against later calls.
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    w = jnp.linspace(-0.5, 0.5, 36).reshape(4, 3, 3)
    x = jnp.linspace(0.1, 0.6, 6).reshape(2, 3)

    def loss(w, ck):
        return jnp.sum(
            er.scan_layers(_Apply(w, lambda w, c: jnp.tanh(c @ w)), x, checkpoint=ck)
        )

    with jax.set_mesh(mesh):
        want = jax.grad(loss)(w, None)
        for ck in (er.every(2), er.recursive()):
            assert eqx.tree_equal(jax.grad(loss)(w, ck), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "ck",
    [
        pytest.param(er.every(3), marks=pytest.mark.heavy),
        er.nested(2),
        pytest.param(er.recursive(), marks=pytest.mark.heavy),
    ],
    ids=str,
)
def test_vmap_conventions(ck):
    depth, width, batch = 11, 4, 3
    layers = make_layers(depth, width)
    xs = jax.random.normal(jax.random.key(2), (batch, width))

    def per_example(layers, x, ck):
        return jnp.sum(er.scan_layers(layers, x, checkpoint=ck) ** 2)

    def batched(layers, xs, ck):
        return jnp.sum(jax.vmap(per_example, (None, 0, None))(layers, xs, ck))

    # grad of vmap (the Equinox convention) and vmap of grad (per-example grads).
    g = jax.grad(batched)(layers, xs, ck)
    assert eqx.tree_equal(g, jax.grad(batched)(layers, xs, None), rtol=1e-5, atol=1e-6)
    pe = jax.vmap(jax.grad(per_example), (None, 0, None))
    assert eqx.tree_equal(
        pe(layers, xs, ck), pe(layers, xs, None), rtol=1e-5, atol=1e-6
    )
    # Batched parameters (an ensemble) and nested vmaps.
    ens = jax.vmap(lambda k: make_layers(depth, width, k))(
        jax.random.split(jax.random.key(3), 2)
    )
    nested = lambda ens, xs, ck: jnp.sum(
        jax.vmap(batched, (0, None, None))(ens, xs, ck)
    )
    assert eqx.tree_equal(
        jax.grad(nested)(ens, xs, ck),
        jax.grad(nested)(ens, xs, None),
        rtol=1e-5,
        atol=1e-6,
    )


class _Centred(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        # A collective over the batch: needs vmap's axis name inside the layer.
        y = jnp.tanh(x * self.w)
        return y - jax.lax.pmean(y, "batch")


@pytest.mark.parametrize(
    "ck", [er.every(2), er.nested(2, "nothing"), er.recursive(), er.binomial(2)]
)
def test_vmap_axis_name_reaches_the_layers(ck):
    # The schedules' vmap rule batches the layers again: with the axis name of
    # the user's vmap, so that collectives over it work.
    layers = _Centred(jnp.linspace(0.5, 1.5, 5))
    xs = jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)

    def loss(layers, ck):
        run = lambda x: er.scan_layers(layers, x, checkpoint=ck)
        return jnp.sum(jnp.sin(jax.vmap(run, axis_name="batch")(xs)))

    got, want = jax.grad(loss)(layers, ck), jax.grad(loss)(layers, None)
    assert eqx.tree_equal(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "ck",
    [er.every(2), er.nested(2), pytest.param(er.recursive(), marks=pytest.mark.heavy)],
    ids=str,
)
def test_grad_of_grad(ck):
    layers = make_layers(6, 3)
    x = jnp.array([[0.1, 0.2, -0.3]])

    def gg(x, ck):
        return jnp.sum(jax.grad(_loss)(layers, x, None, ck).w)

    assert eqx.tree_equal(
        jax.grad(gg)(x, ck), jax.grad(gg)(x, None), rtol=1e-4, atol=1e-6
    )


DEPTH_SCHEDULES = [
    er.every(2),
    er.every(3, policy="dots"),
    er.nested(2),
    er.recursive(),
    er.binomial(2),
]


@pytest.mark.parametrize(
    "ck",
    [
        pytest.param(ck, marks=pytest.mark.heavy) if i < 4 else ck
        for i, ck in enumerate(DEPTH_SCHEDULES)
    ],
    ids=str,
)
def test_forward_over_reverse_matches_unchecked(ck):
    # Hessian-vector products (jax.jvp of jax.grad) and jax.hessian work through
    # every schedule and equal the un-checkpointed ones (float64).
    with jax.enable_x64(True):
        layers = jax.tree.map(
            lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x,
            make_layers(5, 3),
        )
        x = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float64)[None]

        def f(x, c):
            return jnp.sum(er.scan_layers(layers, x, checkpoint=c) ** 2)

        v = jnp.ones_like(x)
        hvp = lambda c: jax.jvp(jax.grad(lambda x: f(x, c)), (x,), (v,))[1]
        assert eqx.tree_equal(hvp(ck), hvp(None), rtol=1e-12, atol=1e-12)
        hessian = lambda c: jax.hessian(lambda x: f(x, c))(x)
        assert eqx.tree_equal(hessian(ck), hessian(None), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ck", DEPTH_SCHEDULES, ids=str)
def test_forward_mode_on_a_schedule_fails_the_same_way(ck):
    layers = make_layers(4, 3)
    x = jnp.ones((1, 3))
    f = lambda x: er.scan_layers(layers, x, checkpoint=ck)
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(f, (x,), (x,))
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jacfwd(lambda x: jnp.sum(f(x)))(x)


def test_policies_keep_forward_mode():
    layers = make_layers(4, 3)
    x = jnp.ones((1, 3))
    g = lambda x: er.scan_layers(layers, x, checkpoint="nothing")
    out, tangent = jax.jvp(g, (x,), (x,))
    ref = jax.jvp(lambda x: er.scan_layers(layers, x), (x,), (x,))
    assert eqx.tree_equal((out, tangent), ref, rtol=1e-5, atol=1e-6)


# --- parameter memory ---------------------------------------------------------

PARAMETER_CHECKPOINTS = [
    "dots",
    "nothing",
    er.every(4),
    er.every(16),
    er.every(4, policy="dots"),
    er.nested(2),
    er.recursive(),
    er.binomial(3),
]


@pytest.mark.heavy
@pytest.mark.parametrize("vmapped", [False, True], ids=["plain", "vmap"])
def test_parameter_dominated_stack_never_exceeds_none(vmapped):
    # Wide layers, a batch of two: parameters dominate (LLM fine-tuning with
    # small micro-batches, FSDP). No checkpoint may cost more than None's temp
    # memory plus one layer's parameters: segments are read by indexing the
    # stack, never copied, and each layer's gradient goes into one buffer.
    width, depth = 256, 16
    layers = make_layers(depth, width)
    x = jnp.ones((2, width))
    layer_bytes = (width * width + width) * 4

    def temp(ck):
        def loss(layers, x):
            if vmapped:
                run = jax.vmap(lambda x: er.scan_layers(layers, x, checkpoint=ck))
                return jnp.sum(run(x) ** 2)
            return jnp.sum(er.scan_layers(layers, x, checkpoint=ck) ** 2)

        return temp_bytes(jax.grad(loss), layers, x)

    base = temp(None)
    for ck in PARAMETER_CHECKPOINTS:
        assert temp(ck) <= base + layer_bytes, (ck, temp(ck), base, layer_bytes)


@pytest.mark.heavy
def test_vmap_costs_at_most_one_layer_more_on_a_parameter_dominated_chain():
    # zoo.ResidualChain (eqx.nn.Linear: an (out, in) weight), width 512, depth
    # 16, batch 2 under jax.vmap. Under vmap the weight gradient of a layer is a
    # real dot (K = batch), and XLA keeps the layer's weight slice alive beside
    # it: one layer's parameters more than None (measured 1.69x None's temp).
    # Forcing the input's cotangent first would need the pullback twice, which
    # on a real block (a transformer layer) recomputes its whole backward chain:
    # not worth one layer of a toy. The bound: None + one layer's parameters.
    import zoo

    model = zoo.ResidualChain(512, 16, key=jax.random.key(0))
    x = jnp.ones((2, 512))
    layer_bytes = (512 * 512 + 512) * 4

    def temp(ck):
        params, static = eqx.partition(er.set_checkpoint(model, ck), eqx.is_array)

        def loss(p, x):
            return jnp.mean(jax.vmap(eqx.combine(p, static))(x) ** 2)

        return temp_bytes(jax.grad(loss), params, x)

    base = temp(None)
    for ck in [er.recursive(), er.binomial(3), er.every(4), er.nested(2)]:
        assert temp(ck) <= base + layer_bytes, (ck, temp(ck), base)


# --- exact evaluation counts ----------------------------------------------------


@pytest.mark.parametrize(
    "depth", [1, *(pytest.param(d, marks=pytest.mark.heavy) for d in (5, 13, 16))]
)
def test_count_flops_follows_the_evaluations_of_every_schedule(depth):
    # Each layer computes `width` tanh's per example, and nothing else in the
    # program is transcendental: the transcendentals of a gradient differ
    # between two schedules by exactly their difference in layer evaluations.
    width = 4
    layers = make_layers(depth, width)
    x = jnp.ones((2, width))

    def tanhs(ck):
        g = jax.grad(lambda m: jnp.sum(er.scan_layers(m, x, checkpoint=ck) ** 2))
        return er.count_flops(g, layers).transcendentals

    ref = er.binomial(depth)  # stores every input: `depth` evaluations
    assert ref.evaluations(depth) == depth
    base = tanhs(ref)
    schedules = [er.recursive()]
    for policy in [None, "nothing", "dots"]:
        schedules += [er.every(k, policy) for k in (1, 3)]
        schedules += [er.nested(n, policy) for n in (2, 3)]
        schedules += [er.binomial(s, policy) for s in (1, 2, 3)]
    for ck in schedules:
        extra = (tanhs(ck) - base) // (2 * width)
        assert extra == ck.evaluations(depth) - depth, ck
        assert (tanhs(ck) - base) % (2 * width) == 0


def test_recursive_evaluations_closed_form():
    # D + D log2(D) / 2 for powers of two (bisection runs half of each segment).
    for depth in (2, 4, 16, 256):
        assert (
            er.recursive().evaluations(depth)
            == depth + depth * int(math.log2(depth)) // 2
        )
    assert er.every(4).evaluations(16) == 16 + 12  # each segment but the last
    assert er.nested(1).evaluations(7) == 7


# --- unroll ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "ck", [None, "dots", er.every(3), er.recursive(), er.binomial(2)], ids=str
)
@pytest.mark.parametrize("unroll", [2, True])
def test_unroll_keeps_gradients(ck, unroll):
    layers = make_layers(5, 3)
    x = jnp.ones((2, 3))

    def loss(layers, unroll):
        out = er.scan_layers(layers, x, checkpoint=ck, unroll=unroll)
        return jnp.sum(out**2)

    ref = jax.grad(loss)(layers, 1)
    assert eqx.tree_equal(jax.grad(loss)(layers, unroll), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ck", [None, "nothing", er.every(2), er.binomial(2)])
@pytest.mark.parametrize("unroll", [np.int64(2), jnp.int32(2)])
def test_unroll_takes_any_integer_type(ck, unroll):
    # Validated with `operator.index`, then passed on as a Python int (`lax.scan`
    # hashes it).
    layers = make_layers(5, 3)
    out = er.scan_layers(layers, jnp.ones((2, 3)), checkpoint=ck, unroll=unroll)
    ref = er.scan_layers(layers, jnp.ones((2, 3)), checkpoint=ck, unroll=2)
    assert eqx.tree_equal(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_unroll_validation(bad):
    layers = make_layers(2, 3)
    # Wrong types may be caught by the runtime type checker first (pytest runs
    # with jaxtyping + beartype); either way the error names `unroll`.
    with pytest.raises((ValueError, TypeError), match="unroll"):
        er.scan_layers(layers, jnp.ones((1, 3)), unroll=bad)


# --- what is saved -----------------------------------------------------------


def _sin_chain(depth, ck):
    return lambda x: jnp.sum(er.chain([jnp.sin] * depth, checkpoint=ck)(x))


@pytest.mark.parametrize("depth,tutorial", [(8, 4), (16, 5)])
def test_recursive_residuals_match_tutorial(depth, tutorial):
    # The JAX remat tutorial's bisection saves 4 values for D = 8 and 5 for
    # D = 16; recursive() saves only the chain's input on the forward pass.
    x = jnp.ones(3)
    res = er.residuals(_sin_chain(depth, er.recursive()), x)
    assert len(res) <= tutorial
    assert sum(r.nbytes for r in res) <= x.nbytes
    # Without checkpointing, every layer's cos is saved.
    assert len(er.residuals(_sin_chain(depth, None), x)) >= depth // depth


@pytest.mark.parametrize("depth", [8, 16, 64, 256])
def test_recursive_recompute_count(depth):
    x = jnp.ones(3)
    jaxpr = jax.make_jaxpr(jax.grad(_sin_chain(depth, er.recursive())))(x).jaxpr
    n = count_primitive(jaxpr, "sin")
    log = math.log2(depth)
    # Primal pass + bisection forwards (D/2 per level) + one per layer's backward.
    assert n == depth + depth * log // 2 + depth
    # Without checkpointing, each layer runs once.
    plain = jax.make_jaxpr(jax.grad(_sin_chain(depth, None)))(x).jaxpr
    assert count_primitive(plain, "sin") == depth
    # The traced program does not grow with the depth beyond O(log D).
    assert len(str(jaxpr)) < 2_000 * (log + 2)


def _residual_stack(depth, width, batch):
    layers = jax.eval_shape(lambda: make_layers(depth, width))
    x = jax.ShapeDtypeStruct((batch, width), jnp.float32)
    return layers, x


def _stack_grad(ck):
    return jax.grad(lambda ls, x: jnp.sum(er.scan_layers(ls, x, checkpoint=ck)))


def _treeverse_grad(checkpoints):
    def loss(layers, x):
        params, static = eqx.partition(layers, eqx.is_array)
        body = lambda c, p: (eqx.combine(p, static)(c), None)
        out, _ = eqxi.scan(
            body, x, params, kind="checkpointed", checkpoints=checkpoints
        )
        return jnp.sum(out)

    return jax.grad(loss)


@pytest.mark.heavy
def test_recursive_memory_beats_treeverse():
    # Residual tanh layers, width 128, batch 4096, f32 (2 MiB per carry).
    mem = {}
    for depth in (64, 1024):
        args = _residual_stack(depth, 128, 4096)
        ours = temp_bytes(_stack_grad(er.recursive()), *args)
        theirs = temp_bytes(_treeverse_grad(int(math.log2(depth))), *args)
        mem[depth] = ours, theirs
    assert mem[64][0] <= 1.0 * mem[64][1]
    assert mem[1024][0] <= 0.85 * mem[1024][1]
    assert mem[1024][0] <= 1.6 * mem[64][0]


@pytest.mark.heavy
def test_recursive_memory_grows_logarithmically():
    carry = 4096 * 128 * 4
    mem = [
        temp_bytes(_stack_grad(er.recursive()), *_residual_stack(d, 128, 4096))
        for d in (64, 256, 1024)
    ]
    # Each quadrupling of the depth adds two stored carries (and no more).
    assert mem[1] - mem[0] <= 2.5 * carry
    assert mem[2] - mem[1] <= 2.5 * carry
    plain = temp_bytes(_stack_grad("nothing"), *_residual_stack(1024, 128, 4096))
    assert plain > 10 * mem[2]


@pytest.mark.heavy
def test_no_schedule_uses_more_memory_than_none_under_vmap():
    # The Equinox convention: per-example layers, vmap over the batch, grad outside.
    layers, _ = _residual_stack(64, 128, 1)
    xs = jax.ShapeDtypeStruct((64, 128), jnp.float32)

    def grad(ck):
        def loss(layers, xs):
            f = lambda x: er.scan_layers(layers, x, checkpoint=ck)
            return jnp.sum(jax.vmap(f)(xs))

        return jax.grad(loss)

    none = temp_bytes(grad(None), layers, xs)
    for ck in [
        "nothing",
        "dots",
        er.every(8),
        er.nested(2),
        er.nested(3),
        er.recursive(),
    ]:
        # With jax 0.12.1, no checkpoint keeps what "dots" keeps in this stack
        # (each matmul's output: 4,391,672 B, against 6,488,832 B with jax
        # 0.10.2), and "dots" compiles to 8 bytes more (4,391,680 B with both):
        # one scalar of the loop's.
        slack = 8 if ck == "dots" and jax.__version_info__ >= (0, 12) else 0
        assert temp_bytes(grad(ck), layers, xs) <= none + slack, ck


# --- bad input ---------------------------------------------------------------


@pytest.mark.parametrize(
    "make,match,param",
    [
        (lambda: er.every(0), r"every: k must be an int >= 1\. Got 0", "k"),
        (lambda: er.every(-2), r"every: k must be an int >= 1\. Got -2", "k"),
        (lambda: er.every(2.5), r"every: k must be an int >= 1\. Got 2\.5", "k"),
        (lambda: er.every(True), r"every: k must be an int >= 1\. Got True", "k"),
        (lambda: er.nested(0), r"nested: levels must be an int >= 1\. Got 0", "levels"),
        (lambda: er.nested("2"), r"nested: levels must be an int >= 1", "levels"),
        (lambda: er.every(2, policy="dot"), r"every: invalid policy\. Unknown", "-"),
        (lambda: er.nested(2, policy=3), r"nested: invalid policy", "-"),
        (lambda: er.recursive(policy="dots"), r"recursive\(\) takes no policy", "-"),
    ],
)
def test_schedule_validation(make, match, param):
    with raises_bad_input(match, param=param):
        make()


def test_schedules_are_values():
    assert er.every(2) == er.every(2) and hash(er.every(2)) == hash(er.every(2))
    assert er.every(2) != er.every(3)
    assert er.nested(2, policy="dots") == er.nested(2, policy="dots")
    assert er.recursive() == er.recursive()


def test_depth_zero_and_mismatched_xs():
    x = jnp.ones((1, 3))
    with pytest.raises(ValueError, match="stack expected at least one key"):
        er.stack(
            lambda k: Layer(jnp.ones((3, 3)), jnp.ones(3)),
            jax.random.split(jax.random.key(0), 0),
        )
    empty = Layer(jnp.ones((0, 3, 3)), jnp.ones((0, 3)))
    for ck in [None, "nothing", er.recursive()]:
        with pytest.raises(ValueError, match=r"depth >= 1.*Got 0"):
            er.scan_layers(empty, x, checkpoint=ck)
    with pytest.raises(ValueError, match="chain expected at least one function"):
        er.chain([])
    with pytest.raises(ValueError, match=r"xs with leading axis 4 .*Got 5"):
        er.scan_layers(make_layers(4, 3), x, jnp.ones(5))
    with pytest.raises(ValueError, match=r"checkpoint expected None.*Unknown policy"):
        er.scan_layers(make_layers(4, 3), x, checkpoint="dot")


def test_layer_changing_the_carry_is_rejected():
    with pytest.raises(ValueError, match="shapes and dtypes of its input"):
        er.chain([lambda x: jnp.concatenate([x, x])], checkpoint=er.recursive())(
            jnp.ones(2)
        )


@pytest.mark.parametrize("ck", [er.every(3), er.recursive()], ids=str)
def test_python_scalar_carry(ck):
    f = er.chain([jnp.sin] * 8, checkpoint=ck)
    g = jax.grad(f)(3.0)
    assert jnp.allclose(g, jax.grad(er.chain([jnp.sin] * 8))(3.0), rtol=1e-5)

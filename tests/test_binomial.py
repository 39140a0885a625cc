import functools
import math

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_primitive
from hypothesis import given

import eqx_remat as er
from eqx_remat._combinators import cpu_keeps_checkpoints
from eqx_remat._schedules._binomial import _schedule, optimal_evaluations


# --- the cost model, computed independently ------------------------------------


@functools.cache
def revolve_dp(length: int, slots: int) -> int:
    """Fewest layer evaluations, outside each layer's own backward step, that
    reverse `length` layers whose input is stored, with `slots` stored carries
    (that input included). By brute force over the first split."""
    if length == 1:
        return 0
    if slots == 1:
        return length * (length - 1) // 2
    return min(
        j + revolve_dp(length - j, slots - 1) + revolve_dp(j, slots)
        for j in range(1, length)
    )


def optimum(depth: int, slots: int) -> int:
    # The forward pass evaluates all `depth` layers and can store carries on the
    # way, so it does the first `depth - 1` evaluations of the reversal, plus one
    # for the last layer's output.
    return revolve_dp(depth, min(slots, depth)) + 1


def test_dp_matches_issue_reference():
    # The issue's reference numbers count a forward pass that stores nothing
    # (D + F); ours stores on the way (F + 1).
    for (depth, slots), ref in {(64, 6): 220, (1024, 10): 4779}.items():
        assert optimal_evaluations(depth, slots) + depth - 1 == ref
    assert optimal_evaluations(64, 6) == optimum(64, 6) == 157


@given(depth=st.integers(1, 300), slots=st.integers(1, 12))
def test_schedule_table_is_a_valid_optimal_revolve(depth, slots):
    """Simulate the action table in Python: every read sees the carry it expects,
    layers are reversed last to first, at most `slots` slots are used, and the
    number of evaluations is the optimum."""
    s = min(slots, depth)
    store_at, actions = _schedule(depth, s)
    work = s
    content = {}  # slot -> index of the carry held (x_i is the input of layer i)
    for i, k in enumerate(store_at):
        content[int(k)] = i
    assert content[0] == 0
    evaluations = depth
    expected_reverse = depth - 1
    for src, pos, n, dst, rev in actions.tolist():
        assert content[src] == pos
        evaluations += n
        if rev:
            assert pos + n == expected_reverse
            expected_reverse -= 1
            content[work] = None
        else:
            assert dst != work and pos + n < depth
            content[dst] = pos + n
    assert expected_reverse == -1
    assert set(content) <= set(range(s + 1))
    assert evaluations == optimum(depth, slots) == optimal_evaluations(depth, slots)


# --- gradients and evaluation counts -------------------------------------------


class Layer(eqx.Module):
    w: jax.Array
    b: jax.Array

    def __call__(self, x, t=None):
        jax.debug.callback(_tick, x)  # depends on x: not hoisted out of loops
        y = x + jnp.tanh(x @ self.w + jnp.broadcast_to(self.b, x.shape))
        return y if t is None else y * t


_COUNT = [0]


def _tick(_):
    _COUNT[0] += 1


def count(fn, *args):
    """Run `fn` and return (its output, how many times a layer was evaluated)."""
    jax.effects_barrier()
    _COUNT[0] = 0
    out = jax.block_until_ready(fn(*args))
    jax.effects_barrier()
    return out, _COUNT[0]


def make_layers(depth, width, key=jax.random.key(0)):
    def make(k):
        kw, kb = jax.random.split(k)
        return Layer(
            jax.random.normal(kw, (width, width)) / (2 * math.sqrt(width)),
            jax.random.normal(kb, (width,)) / 10,
        )

    return er.stack(make, jax.random.split(key, depth))


def _loss(layers, x, ts, ck):
    return jnp.sum(er.scan_layers(layers, x, ts, checkpoint=ck) ** 2)


_grad = jax.jit(jax.grad(_loss, argnums=(0, 1)), static_argnums=3)


def _chain_loss(mods, x, depth, ck):
    # Three different modules, cycled: closed-over arrays differentiated.
    fns = [mods[i % 3] for i in range(depth)]
    return jnp.sum(er.chain(fns, checkpoint=ck)(x) ** 2)


_chain_grad = jax.jit(jax.grad(_chain_loss, argnums=(0, 1)), static_argnums=(2, 3))


@pytest.mark.heavy
@given(
    depth=st.integers(1, 64),
    slots=st.integers(1, 8),
    through=st.sampled_from(["scan_layers", "scan_layers with xs", "chain"]),
)
@pytest.mark.filterwarnings("ignore::eqx_remat.StackedListWarning")
def test_gradients_and_evaluations(depth, slots, through):
    """The scanned schedule evaluates the layers the optimal number of times.
    A chain of modules of one structure is a list of layers, scanned where it
    is stacked: on the CPU with jax 0.10.2, whose compiler runs a checkpoint
    outside a loop as none (`cpu_keeps_checkpoints`), with a warning. Where it
    runs in place (jax >= 0.11), it is Revolve's splits as nested
    `jax.checkpoint`s (`binomial.unrolled`), whose evaluations JAX decides:
    only its gradients are checked (jax 0.12.1: 15 evaluations for 5 layers and
    2 slots, against the scan's 12)."""
    x = jax.random.normal(jax.random.key(1), (2, 3))
    if through == "chain":
        mods = [make_layers(1, 3, jax.random.key(k)) for k in range(3)]
        mods = [jax.tree.map(lambda a: a[0], m) for m in mods]
        args = (mods, x, depth)
        grad = _chain_grad
    else:
        ts = jnp.linspace(0.9, 1.1, depth) if through.endswith("xs") else None
        args = (make_layers(depth, 3), x, ts)
        grad = _grad
    g, n = count(grad, *args, er.binomial(slots))
    g_ref, n_ref = count(grad, *args, None)
    assert eqx.tree_equal(g, g_ref, rtol=1e-5, atol=1e-6)
    assert n_ref == depth
    # The tests run on the CPU (conftest.py).
    scanned = through != "chain" or depth == 1 or not cpu_keeps_checkpoints()
    if scanned:
        # Each layer's backward step evaluates it once more (jax.vjp).
        assert n == optimum(depth, slots) + depth


def test_plain_remat_when_slots_cover_the_depth():
    layers = make_layers(9, 3)
    x = jnp.ones((1, 3))
    ref, plain = count(_grad, layers, x, None, "nothing")
    assert plain == 2 * 9
    g, n = count(_grad, layers, x, None, er.binomial(9))
    assert eqx.tree_equal(g, ref, rtol=1e-5, atol=1e-6) and n == plain
    # With an inner policy too (it only changes what one layer's vjp keeps).
    assert eqx.tree_equal(
        _grad(layers, x, None, er.binomial(100, policy="dots")),
        ref,
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("depth,slots", [(1, 1), (5, 1), (16, 3), (23, 2)])
def test_chain_gradients(depth, slots):
    ws = [jnp.full((3,), 0.1 * i) for i in range(3)]
    fns = [jnp.sin, lambda x: x * ws[0] + 1.0, eqx.nn.Lambda(jnp.tanh)]
    fns = [fns[i % 3] for i in range(depth)]

    def loss(x, ws0, ck):
        ws[0] = ws0  # a closed-over array that is differentiated
        return jnp.sum(er.chain(fns, checkpoint=ck)(x) ** 2)

    x, w = jnp.array([0.3, -0.2, 0.5]), ws[0]
    g = jax.grad(loss, argnums=(0, 1))(x, w, er.binomial(slots))
    g_ref = jax.grad(loss, argnums=(0, 1))(x, w, None)
    assert eqx.tree_equal(g, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.heavy
def test_vmap_conventions():
    depth, width, batch, ck = 11, 4, 3, er.binomial(3)
    layers = make_layers(depth, width)
    xs = jax.random.normal(jax.random.key(2), (batch, width))

    def per_example(layers, x, ck):
        return jnp.sum(er.scan_layers(layers, x, checkpoint=ck) ** 2)

    def batched(layers, xs, ck):
        return jnp.sum(jax.vmap(per_example, (None, 0, None))(layers, xs, ck))

    # grad of vmap (the Equinox convention) and vmap of grad (per-example grads).
    g = jax.jit(jax.grad(batched), static_argnums=2)
    assert eqx.tree_equal(g(layers, xs, ck), g(layers, xs, None), rtol=1e-5, atol=1e-6)
    pe = jax.jit(jax.vmap(jax.grad(per_example), (None, 0, None)), static_argnums=2)
    assert eqx.tree_equal(
        pe(layers, xs, ck), pe(layers, xs, None), rtol=1e-5, atol=1e-6
    )
    # Batched parameters (an ensemble): vmap outside vmap.
    ens = jax.vmap(lambda k: make_layers(depth, width, k))(
        jax.random.split(jax.random.key(3), 2)
    )

    def nested(ens, xs, ck):
        return jnp.sum(jax.vmap(batched, (0, None, None))(ens, xs, ck))

    g = jax.jit(jax.grad(nested), static_argnums=2)
    assert eqx.tree_equal(g(ens, xs, ck), g(ens, xs, None), rtol=1e-5, atol=1e-6)


@pytest.mark.heavy
def test_second_order():
    layers = make_layers(6, 3)
    x = jnp.array([[0.1, 0.2, -0.3]])

    def gg(x, ck):
        return jnp.sum(jax.grad(_loss)(layers, x, None, ck).w)

    # Reverse over reverse, and forward over reverse (Hessian-vector products).
    rr = jax.jit(jax.grad(gg), static_argnums=1)
    assert eqx.tree_equal(rr(x, er.binomial(2)), rr(x, None), rtol=1e-4, atol=1e-6)
    fr = jax.jit(
        lambda x, ck: jax.jvp(lambda x: gg(x, ck), (x,), (jnp.ones_like(x),)),
        static_argnums=1,
    )
    assert eqx.tree_equal(fr(x, er.binomial(2)), fr(x, None), rtol=1e-4, atol=1e-6)


def test_forward_mode_fails_clearly():
    layers = make_layers(4, 3)
    x = jnp.ones((1, 3))
    f = lambda x: er.scan_layers(layers, x, checkpoint=er.binomial(2))
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(f, (x,), (x,))


# --- what it costs -------------------------------------------------------------


def test_program_size_is_logarithmic_in_depth():
    def grad(depth):
        layers = jax.eval_shape(lambda: make_layers(depth, 2))
        x = jax.ShapeDtypeStruct((1, 2), jnp.float32)
        return jax.make_jaxpr(jax.grad(_loss), static_argnums=3)(
            layers, x, None, er.binomial(1)
        ).jaxpr

    # One slot: the longest advance is D - 2 layers, the worst case for the
    # binary decomposition of advances.
    small, large = (
        count_primitive(grad(d), "tanh", weighted=False) for d in (64, 4096)
    )
    assert large - small == math.log2(4096) - math.log2(64)
    assert large <= math.log2(4096) + 4


class _Scale(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return jnp.tanh(x * self.w)


@pytest.mark.parametrize(
    "depth, slots", [(1500, 2), (2048, 3), (3000, 5), (2500, 8), (4096, 12)]
)
def test_count_flops_is_exact_on_deep_stacks(depth, slots):
    # One tanh per layer evaluation, and one more in each layer's backward
    # step: binomial's action table here is larger than any size cut-off would
    # let through, and every `lax.cond` it decides must still be followed.
    layers = _Scale(jnp.linspace(0.5, 1.0, depth))
    ck = er.binomial(slots)

    def loss(layers):
        return jnp.sum(er.scan_layers(layers, jnp.ones(()), checkpoint=ck))

    count = er.count_flops(jax.grad(loss), layers)
    assert count.transcendentals == ck.evaluations(depth) + depth
    assert count.transcendentals == optimal_evaluations(depth, slots) + depth


@pytest.mark.heavy
def test_memory_falls_and_evaluations_rise_as_slots_fall():
    depth, width, batch = 48, 16, 256  # a carry (16 KiB) outweighs a layer (1 KiB)
    layers = make_layers(depth, width)
    x = jnp.ones((batch, width))
    mem, evals = [], []
    slots = [48, 8, 4, 2, 1]
    for s in slots:
        compiled = _grad.lower(layers, x, None, er.binomial(s)).compile()
        mem.append(compiled.memory_analysis().temp_size_in_bytes)
        evals.append(count(compiled, layers, x, None)[1] - depth)
    assert evals == [optimum(depth, s) for s in slots]
    assert all(a > b for a, b in zip(mem, mem[1:])), mem
    assert all(a < b for a, b in zip(evals, evals[1:])), evals
    # At most `slots` stored carries plus one working carry, and a few carries'
    # worth for differentiating one layer (its output, cotangent, residuals).
    carry = batch * width * 4
    for s, m in zip(slots, mem):
        assert (s + 1) * carry < m <= (s + 1 + 5) * carry, (s, m / carry)
    # With every carry stored it costs what per-layer remat does (± 2 carries).
    plain = _grad.lower(layers, x, None, "nothing").compile()
    assert abs(mem[0] - plain.memory_analysis().temp_size_in_bytes) <= 2 * carry


# --- bad input -----------------------------------------------------------------


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: er.binomial(0), r"binomial: slots must be an int >= 1\. Got 0"),
        (lambda: er.binomial(True), r"binomial: slots must be .* of type bool"),
        (lambda: er.binomial(2, policy="dot"), r"binomial: invalid policy"),
        (lambda: er.binomial(2, policy=3), r"binomial: invalid policy"),
    ],
)
def test_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_validation_of_a_float():
    # Without pytest's jaxtyping hook this is the ValueError; with it, the hook's
    # TypeCheckError (a TypeError) fires first. Both name the argument.
    with pytest.raises((ValueError, TypeError), match="slots"):
        er.binomial(2.0)


def test_binomial_is_a_value():
    assert er.binomial(3) == er.binomial(3)
    assert hash(er.binomial(3, policy="dots")) == hash(er.binomial(3, policy="dots"))
    assert er.binomial(3) != er.binomial(4)
    assert isinstance(er.binomial(3), er.Schedule)
    assert np.asarray(_schedule(10, 3)[1]).flags.writeable is False

"""eqx_remat.ranges: different checkpoints for consecutive ranges of one stack."""

import math

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from hypothesis import given
from test_schedules import make_layers
from zoo_helpers import build, quick_jit

import eqx_remat as er
import zoo


# --- a value ------------------------------------------------------------------


def test_ranges_are_values():
    a = er.ranges((2, None), (3, "dots"), (1, er.every(2, policy="nothing")))
    b = er.ranges([2, None], (3, "dots"), (1, er.every(2, policy="nothing")))
    assert a == b and hash(a) == hash(b)
    assert a != er.ranges((2, None), (3, "dots"), (1, er.every(3)))
    assert a != er.ranges((3, "dots"), (2, None), (1, er.every(2, policy="nothing")))
    assert a.depth == 6 and a.policy is None
    assert a.parts == ((2, None), (3, "dots"), (1, er.every(2, policy="nothing")))
    assert repr(er.ranges((2, None), (3, "dots"))) == "ranges((2, None), (3, 'dots'))"
    with pytest.raises(dataclasses_frozen_error()):
        a.parts = ()  # pyright: ignore[reportAttributeAccessIssue]  # frozen
    # Equal values do not recompile.
    f = jax.jit(
        lambda x, ck: er.scan_layers(make_layers(2, 3), x, checkpoint=ck),
        static_argnums=1,
    )
    for ck in [er.ranges((1, None), (1, "dots")), er.ranges((1, None), (1, "dots"))]:
        f(jnp.ones(3), ck)
    assert f._cache_size() == 1


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize(
    "parts, match",
    [
        ((), "at least one"),
        (((2, None), 3), r"\(count, checkpoint\) pairs.*Got 3 at position 1"),
        (((2, None, 1),), r"pairs.*Got \(2, None, 1\) at position 0"),
        (((0, None),), "the count of pair 0 must be an int >= 1. Got 0"),
        (((2, None), (True, "dots")), "the count of pair 1 must be an int >= 1"),
        (((2, None), (2.0, "dots")), "the count of pair 1 must be an int >= 1"),
        (((2, None), (2, "dot")), r"pair 1 \(2, 'dot'\).*Unknown policy 'dot'"),
        (((2, er.ranges((2, None))),), "not itself a ranges.*in pair 0"),
    ],
    ids=["empty", "not-a-pair", "triple", "zero", "bool", "float", "policy", "nested"],
)
def test_ranges_validation_names_the_bad_pair(parts, match):
    with pytest.raises(ValueError, match=match):
        er.ranges(*parts)


def test_a_bad_part_lists_what_a_part_may_be():
    """The schedules a part may be are listed, and `ranges`, which a part may
    not be, is not among them (a `checkpoint` elsewhere may be a `ranges`)."""
    with pytest.raises(ValueError) as part:
        er.ranges((2, "dot"))
    assert "binomial)" in str(part.value) and "ranges)" not in str(part.value)
    with pytest.raises(ValueError, match=r"binomial, ranges\)"):
        er.set_checkpoint(None, "dot")


def test_counts_that_do_not_add_up_fail_at_trace_time():
    layers = make_layers(5, 3)
    ck = er.ranges((2, None), (2, "dots"))
    msg = r"add up to the depth of the stack, 5 layers. Got 2 \+ 2 = 4 layers"
    # The forward pass alone, its gradient, under vmap, and a zoo model.
    with pytest.raises(ValueError, match=msg):
        jax.eval_shape(lambda x: er.scan_layers(layers, x, checkpoint=ck), jnp.ones(3))
    with pytest.raises(ValueError, match=msg):
        jax.eval_shape(
            jax.grad(lambda x: er.scan_layers(layers, x, checkpoint=ck).sum()),
            jnp.ones(3),
        )
    with pytest.raises(ValueError, match=msg):
        jax.eval_shape(
            jax.vmap(lambda x: er.scan_layers(layers, x, checkpoint=ck)),
            jnp.ones((2, 3)),
        )
    model = zoo.MLP(3, 2, 4, 3, checkpoint=ck, key=jr.key(0))  # checked when traced
    with pytest.raises(ValueError, match="3 layers. Got 2 \\+ 2 = 4"):
        jax.eval_shape(model, jnp.ones(3))
    with pytest.raises(ValueError, match=msg):
        ck.evaluations(5)


# --- gradients ----------------------------------------------------------------

# Every kind of checkpoint a range may have. The name policies use the tag that
# every zoo model has.
RANGE_CHECKPOINTS = [
    None,
    "nothing",
    "dots",
    "everything",
    er.save_names("layer_input"),
    er.save_all_but_names("layer_input"),
    er.offload_names("layer_input"),
    er.save_and_offload_names(save=("layer_input",)),
    er.every(2),
    er.every(3, policy="dots"),
    er.nested(2),
    er.recursive(),
    er.binomial(2),
    er.binomial(1, policy="nothing"),
]


def _mlp(depth, ck, unroll):
    model = build(zoo.MLP, 3, 2, 8, depth, checkpoint=ck, unroll=unroll, key=jr.key(0))
    return model, jnp.linspace(-1.0, 1.0, 3)


def _chain(depth, ck, unroll):
    model = build(
        zoo.ResidualChain, 4, depth, checkpoint=ck, unroll=unroll, key=jr.key(1)
    )
    return model, jnp.linspace(-1.0, 1.0, 4)


def _transformer(depth, ck, unroll):
    model = build(
        zoo.Transformer, 16, 8, 8, 2, depth, checkpoint=ck, unroll=unroll, key=jr.key(2)
    )
    return model, jnp.array([1, 5, 2, 7], dtype=jnp.int32)


MODELS = {"mlp": _mlp, "residual_chain": _chain, "transformer": _transformer}


def _loss(model, x, vmapped):
    if vmapped:
        xs = jnp.stack([x, x[::-1]])
        return jnp.sum(jax.vmap(model)(xs) ** 2)
    return jnp.sum(model(x) ** 2)


_grad = quick_jit(eqx.filter_grad(_loss))


@pytest.mark.heavy
@given(
    parts=st.lists(
        st.tuples(st.integers(1, 3), st.sampled_from(RANGE_CHECKPOINTS)),
        min_size=1,
        max_size=3,
    ),
    model=st.sampled_from(sorted(MODELS)),
    vmapped=st.booleans(),
    unroll=st.sampled_from([1, 2]),
)
def test_gradients_equal_the_unchecked_ones(parts, model, vmapped, unroll):
    ck = er.ranges(*parts)
    m, x = MODELS[model](ck.depth, ck, unroll)
    g = _grad(m, x, vmapped)
    g_ref = _grad(er.set_checkpoint(m, None), x, vmapped)
    # The leaves: the gradients' static `checkpoint` fields differ.
    assert eqx.tree_equal(
        jax.tree.leaves(g), jax.tree.leaves(g_ref), rtol=1e-4, atol=1e-6
    )


@pytest.mark.parametrize(
    "depth", [1, pytest.param(7, marks=pytest.mark.heavy)], ids=lambda d: f"D{d}"
)
def test_scan_layers_chain_and_set_checkpoint_take_ranges(depth):
    layers = make_layers(depth, 3)
    x = jnp.array([[0.1, -0.4, 0.3]])
    parts = [(1, er.recursive())] + ([(4, "dots"), (2, None)] if depth > 1 else [])
    ck = er.ranges(*parts)

    def loss(layers, x, ck):
        ts = jnp.linspace(0.9, 1.1, depth)
        return jnp.sum(er.scan_layers(layers, x, ts, checkpoint=ck) ** 2)

    g = jax.grad(loss, argnums=(0, 1))
    assert eqx.tree_equal(g(layers, x, ck), g(layers, x, None), rtol=1e-5, atol=1e-6)
    w = jnp.array([0.5, 0.9, -0.4])

    def chained(x, w, ck):
        fns = [jnp.sin, lambda x: x * w + 1.0, eqx.nn.Lambda(jnp.tanh)]
        return jnp.sum(er.chain([fns[i % 3] for i in range(depth)], checkpoint=ck)(x))

    g = jax.grad(chained, argnums=(0, 1))
    assert eqx.tree_equal(g(x[0], w, ck), g(x[0], w, None), rtol=1e-5, atol=1e-6)
    model = er.set_checkpoint(zoo.ResidualChain(3, depth, key=jr.key(0)), ck)
    assert model.checkpoint == ck


@pytest.mark.heavy
def test_second_order_through_ranges():
    # grad of grad, and forward-over-reverse (float64, tight), through
    # per-layer ranges and a schedule range.
    layers = make_layers(6, 3)
    x = jnp.array([[0.1, 0.2, -0.3]])
    ck = er.ranges((2, None), (2, "dots"), (2, er.every(2)))

    def loss(layers, x, ck):
        return jnp.sum(er.scan_layers(layers, x, checkpoint=ck) ** 2)

    def gg(x, ck):
        return jnp.sum(jax.grad(loss)(layers, x, ck).w)

    assert eqx.tree_equal(
        jax.grad(gg)(x, ck), jax.grad(gg)(x, None), rtol=1e-4, atol=1e-6
    )
    with jax.enable_x64(True):
        l64 = jax.tree.map(lambda a: a.astype(jnp.float64), layers)
        x64 = x.astype(jnp.float64)

        def hvp(ck):
            g = jax.grad(lambda x: loss(l64, x, ck))
            return jax.jvp(g, (x64,), (jnp.ones_like(x64),))[1]

        assert eqx.tree_equal(hvp(ck), hvp(None), rtol=1e-12, atol=1e-12)


def test_plan_takes_ranges_among_its_candidates():
    model = zoo.MLP(3, 2, 8, 4, key=jr.key(0))
    ck = er.ranges((2, None), (2, er.recursive()))
    result = er.plan(
        eqx.filter_grad(lambda m, x: jnp.sum(m(x))),
        model,
        jnp.ones(3),
        budget_bytes=2**30,
        candidates=[ck, "nothing"],
    )
    assert [e.checkpoint for e in result.table] == [ck, "nothing"]
    assert all(e.fits for e in result.table)


# --- memory -------------------------------------------------------------------

PARAMETER_RANGES = [
    er.ranges((4, None), (4, "dots")),
    er.ranges((2, "nothing"), (3, er.recursive()), (3, None)),
    er.ranges((3, er.binomial(2)), (5, er.every(2, policy="dots"))),
    er.ranges((1, "dots"), (7, None)),
    er.ranges((8, None)),
]


@pytest.mark.heavy
@pytest.mark.parametrize("vmapped", [False, True], ids=["plain", "vmap"])
def test_parameter_dominated_stack_stays_within_none_plus_one_layer(vmapped):
    # Wide layers, a batch of two: parameters dominate. No range copies its
    # part of the stack (the transpose of a slice would be a full-size
    # gradient per range): every range reads its layers from the one stack.
    width, depth = 512, 8
    layers = make_layers(depth, width)
    x = jnp.ones((2, width))
    layer_bytes = (width * width + width) * 4

    def temp(ck):
        def loss(layers, x):
            if vmapped:
                run = jax.vmap(lambda x: er.scan_layers(layers, x, checkpoint=ck))
                return jnp.sum(run(x) ** 2)
            return jnp.sum(er.scan_layers(layers, x, checkpoint=ck) ** 2)

        return er.memory_report(jax.grad(loss), layers, x).temp_bytes

    base = temp(None)
    for ck in PARAMETER_RANGES:
        assert temp(ck) <= base + layer_bytes, (ck, temp(ck), base, layer_bytes)


@pytest.mark.heavy
@pytest.mark.parametrize("c", [None, "dots", "nothing"], ids=str)
def test_a_range_of_one_layer_keeps_what_longer_ranges_keep(c):
    # Out of a loop, XLA would run a policy's recomputation as early as the
    # forward pass and keep all it computes (a first range of one layer under
    # "nothing" needed 1.75x the uniform stack): every range keeps, per layer,
    # what a longer range of the same checkpoint keeps.
    depth = 4
    model = zoo.Transformer(64, 128, 64, 2, depth, key=jr.key(0))
    tokens = jnp.zeros((2, 128), dtype=jnp.int32)

    def loss(model, tokens):
        return jnp.sum(jax.vmap(model)(tokens) ** 2)

    def temp(ck):
        m = er.set_checkpoint(model, ck)
        return er.memory_report(eqx.filter_grad(loss), m, tokens).temp_bytes

    uniform = temp(er.ranges((depth, c)))
    first = temp(er.ranges((1, c), (depth - 1, c)))
    if c is None:
        # None recomputes nothing, so nothing can be hoisted: per layer, the
        # ranges save the same bytes. Each range also keeps, once, what depends
        # on no layer input (the causal mask): a split keeps that once more,
        # wherever it is. Their compiled temp differs only by XLA's schedule of
        # two loops (0.95x with jax.nn.gelu, 1.04x with zoo.gelu).
        def saved(ck):
            m = er.set_checkpoint(model, ck)
            return sum(r.nbytes for r in er.residuals(loss, m, tokens))

        split, one = (
            saved(er.ranges((1, c), (depth - 1, c))),
            saved(er.ranges((depth, c))),
        )
        assert split == saved(er.ranges((2, c), (depth - 2, c)))
        assert 0 <= split - one < one / depth, (split, one)
        assert first <= 1.05 * uniform + (split - one), (first, uniform)
    else:
        assert 0.98 * uniform <= first <= 1.02 * uniform, (first, uniform)
    # A last range's backward step follows its forward pass: never more.
    last = temp(er.ranges((depth - 1, c), (1, c)))
    assert last <= 1.02 * uniform, (last, uniform)
    if c == "nothing":
        assert uniform < 0.5 * temp(er.ranges((depth, None)))


@pytest.mark.parametrize(
    "c",
    [er.ranges((8, None)), er.ranges((4, None), (4, "nothing")), er.every(2)],
    ids=str,
)
def test_what_depends_on_no_layer_input_is_kept_once(c):
    """A residual of every layer that depends on neither the layer nor its
    input (here a causal mask) is kept once per range or segment, as JAX's scan
    hoists it out of its loop, not once per layer (8 x 4 KiB before)."""
    depth, n = 8, 64

    class Layer(eqx.Module):
        w: jax.Array
        masked: bool = eqx.field(static=True)

        def __call__(self, h):
            y = jnp.tanh(h @ self.w)
            return (
                jnp.where(jnp.tril(jnp.ones((n, n), bool)), y, 0.0)
                if self.masked
                else y
            )

    x = jr.normal(jr.key(1), (n, n))

    def temp(masked):
        keys = jr.split(jr.key(0), depth)
        layers = er.stack(lambda k: Layer(jr.normal(k, (n, n)) / n, masked), keys)
        grad = jax.grad(lambda s, x: er.scan_layers(s, x, checkpoint=c).sum())
        return er.memory_report(grad, layers, x).temp_bytes

    mask = n * n  # bytes of one bool mask
    assert temp(True) - temp(False) <= 2 * mask


def test_residuals_name_each_range():
    ck = er.ranges((2, None), (3, "dots"), (1, er.recursive()))
    model = zoo.MLP(3, 2, 8, 6, checkpoint=ck, key=jr.key(0))
    res = er.residuals(lambda m, x: jnp.sum(m(x)), model, jnp.ones(3))
    by_range = {
        k: [r for r in res if f"ranges[{k}] (layers " in r.source] for k in range(3)
    }
    # Range 0 (no checkpointing) keeps every residual of its 2 layers, tagged
    # ones included; range 1 ("dots") its 3 layer inputs and matmuls; range 2
    # (bisection) only its input, the output of range 1.
    assert all(
        r.source.endswith("in ranges[0] (layers 0..1: None)") for r in by_range[0]
    )
    assert {r.name for r in by_range[0]} >= {"layer_input", "linear"}
    assert {r.layers for r in by_range[0] if r.name} == {2}
    stacked = [r for r in by_range[1] if r.layers == 3]
    assert len(stacked) == 2 and all(r.layer_shape == (8,) for r in stacked)
    assert all("in ranges[1] (layers 2..4: 'dots')" in r.source for r in stacked)
    carries = [r for r in res if "the output of ranges[1]" in r.source]
    assert len(carries) == 1 and carries[0].shape == (8,)
    # Every per-layer residual of the stack belongs to a range.
    assert all("ranges[" in r.source for r in res if r.layers > 1)


# --- FLOPs --------------------------------------------------------------------


def _tanhs(layers, ck, x):
    g = jax.grad(lambda m: jnp.sum(er.scan_layers(m, x, checkpoint=ck) ** 2))
    return er.count_flops(g, layers).transcendentals


@pytest.mark.parametrize(
    "parts",
    [
        ((3, None), (10, er.binomial(3))),
        ((5, "nothing"), (4, er.every(3)), (4, "dots")),
        ((6, er.recursive()), (7, er.nested(2, policy="nothing"))),
        ((13, er.recursive()),),
    ],
    ids=str,
)
def test_count_flops_is_the_sum_of_the_ranges(parts):
    # Each layer computes `width` tanh's per example and nothing else in the
    # program is transcendental: a range's count is that of its layers
    # checkpointed uniformly, and the counts of the ranges add up exactly.
    width, depth, batch = 4, 13, 2
    layers = make_layers(depth, width)
    x = jnp.ones((batch, width))
    ck = er.ranges(*parts)
    total, start = 0, 0
    for n, c in parts:
        part = jax.tree.map(lambda a, s=start, n=n: a[s : s + n], layers)
        total += _tanhs(part, c, x)
        start += n
    assert _tanhs(layers, ck, x) == total

    # In evaluations: the forward pass, the re-runs and the policies'
    # recomputes (`evaluations`), plus the backward step of each layer of a
    # schedule (its vjp at a recomputed input).
    in_schedules = sum(n for n, c in parts if isinstance(c, er.Schedule))
    expected = ck.evaluations(depth) + in_schedules
    assert _tanhs(layers, ck, x) == batch * width * expected


def test_evaluations_are_the_sum_of_the_ranges():
    ck = er.ranges((3, None), (10, er.binomial(3)), (4, "dots"), (16, er.recursive()))
    # None: the forward pass; a policy: the forward pass and its recompute.
    assert ck.evaluations(33) == 3 + er.binomial(3).evaluations(10) + 2 * 4 + (
        16 + 16 * int(math.log2(16)) // 2
    )
    one = er.every(4)
    assert er.ranges((16, one)).evaluations(16) == one.evaluations(16)

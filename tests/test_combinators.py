"""A user's own model: a list or tuple of blocks under `scan_layers` and `chain`
(stacked once, no `lax.switch`), and `eqx_remat.Stacked` as one field of a model
with no `checkpoint` field of its own."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import pytest
from helpers import count_primitive, temp_bytes

import eqx_remat as er


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    linear: eqx.nn.Linear

    def __init__(self, width, *, key):
        self.norm = eqx.nn.LayerNorm(width)
        self.linear = eqx.nn.Linear(width, width, key=key)

    def __call__(self, x, t=None):
        y = x + jnp.tanh(self.linear(self.norm(x)))
        return y if t is None else y * t


KEY = jax.random.key(0)


def blocks(depth=5, width=8, key=KEY):
    return [Block(width, key=k) for k in jax.random.split(key, depth)]


def loop(blocks, x):
    """The user's code before: a Python loop over the blocks."""
    for b in blocks:
        x = b(x)
    return x


CHECKPOINTS = [None, "dots", er.every(2), er.recursive()]
APPLY = {
    "scan_layers": lambda bs, x, ck: er.scan_layers(bs, x, checkpoint=ck),
    "chain": lambda bs, x, ck: er.chain(bs, checkpoint=ck)(x),
    "Stacked": lambda bs, x, ck: er.Stacked(bs, checkpoint=ck)(x),
}


@pytest.mark.parametrize("container", [list, tuple], ids=["list", "tuple"])
@pytest.mark.parametrize("apply", list(APPLY), ids=list(APPLY))
@pytest.mark.parametrize("ck", CHECKPOINTS, ids=str)
def test_list_of_blocks_matches_the_python_loop(ck, apply, container):
    bs, x = container(blocks()), jnp.linspace(-1.0, 1.0, 8)
    loss = lambda bs, x, f: jnp.sum(f(bs, x) ** 2)
    out = APPLY[apply](bs, x, ck)
    assert eqx.tree_equal(out, loop(bs, x), rtol=1e-5, atol=1e-6)
    grads = jax.grad(loss, argnums=(0, 1))(bs, x, lambda bs, x: APPLY[apply](bs, x, ck))
    want = jax.grad(loss, argnums=(0, 1))(bs, x, loop)
    assert type(grads[0]) is container
    assert eqx.tree_equal(grads, want, rtol=1e-5, atol=1e-6)


def test_list_of_blocks_with_per_layer_inputs():
    bs, x = blocks(), jnp.linspace(-1.0, 1.0, 8)
    ts = jnp.linspace(0.9, 1.1, len(bs))
    want = x
    for b, t in zip(bs, ts):
        want = b(want, t)
    assert eqx.tree_equal(
        er.scan_layers(bs, x, ts, checkpoint="dots"), want, rtol=1e-5, atol=1e-6
    )
    assert eqx.tree_equal(
        er.Stacked(bs, checkpoint=er.every(2))(x, ts), want, rtol=1e-5, atol=1e-6
    )


def _stack_by_hand(bs):
    params = [eqx.filter(b, eqx.is_array) for b in bs]
    stacked = jtu.tree_map(lambda *xs: jnp.stack(xs), *params)
    return eqx.combine(stacked, eqx.filter(bs[0], eqx.is_array, inverse=True))


@pytest.mark.parametrize(
    "ck",
    [
        pytest.param(None, marks=pytest.mark.heavy),
        "dots",
        pytest.param(er.every(2), marks=pytest.mark.heavy),
    ],
    ids=str,
)
def test_list_memory_is_stacking_by_hand_no_switch(ck):
    """Width 64, 6 blocks: the list path compiles to what stacking by hand inside
    the step compiles to (±2%), and costs at most the stack and its gradient
    (2 x the parameters) more than a stack passed in (`Stacked`): no branch per
    block is kept."""
    bs, x = blocks(depth=6, width=64), jnp.ones(64)
    params = sum(p.nbytes for p in jtu.tree_leaves(eqx.filter(bs, eqx.is_array)))
    grad = lambda f: jax.grad(lambda bs, x: jnp.sum(f(bs, x) ** 2))
    scan = lambda bs, x: er.scan_layers(bs, x, checkpoint=ck)
    by_list = temp_bytes(grad(scan), bs, x)
    by_chain = temp_bytes(grad(lambda bs, x: er.chain(bs, checkpoint=ck)(x)), bs, x)
    by_hand = temp_bytes(grad(lambda bs, x: scan(_stack_by_hand(bs), x)), bs, x)
    prestacked = temp_bytes(grad(scan), _stack_by_hand(bs), x)
    assert abs(by_list - by_hand) <= 0.02 * by_hand, (by_list, by_hand)
    assert abs(by_chain - by_hand) <= 0.02 * by_hand, (by_chain, by_hand)
    assert by_list <= 1.02 * (prestacked + 2 * params), (by_list, prestacked, params)
    jaxpr = jax.make_jaxpr(grad(lambda bs, x: er.chain(bs, checkpoint=ck)(x)))(bs, x)
    assert count_primitive(jaxpr.jaxpr, "cond", weighted=False) == 0


def test_chain_of_different_modules_still_switches():
    """Modules that cannot be stacked are different callables, as before."""
    a, b = eqx.nn.Lambda(jnp.sin), eqx.nn.Linear(3, 3, key=jax.random.key(0))
    x = jnp.array([0.3, -0.2, 0.5])
    assert eqx.tree_equal(
        er.chain([a, b, a], checkpoint="dots")(x), a(b(a(x))), rtol=1e-5, atol=1e-6
    )


def _with(block, where, value):
    return eqx.tree_at(where, block, value)


def _differing():
    bs = blocks(depth=5)
    weight = lambda b: b.linear.weight
    return {
        "shape": (
            bs[:3] + [_with(bs[3], weight, jnp.ones((4, 8)))] + bs[4:],
            r"layers\[3\]\.linear\.weight has shape \(4, 8\) float32, not shape "
            r"\(8, 8\) float32 as in layers\[0\]",
        ),
        "width": (
            bs[:3] + [Block(4, key=jax.random.key(1))] + bs[4:],
            r"layers\[3\]\.norm\.shape \(static\) is \(4,\), not \(8,\)",
        ),
        "dtype": (
            bs[:2] + [_with(bs[2], weight, jnp.ones((8, 8), jnp.bfloat16))],
            r"layers\[2\]\.linear\.weight has shape \(8, 8\) bfloat16, not shape "
            r"\(8, 8\) float32",
        ),
        "type": (
            bs[:1] + [eqx.nn.Linear(8, 8, key=jax.random.key(1))],
            r"layers\[1\] is a Linear, not a Block",
        ),
        "static": (
            bs[:4] + [_with(bs[4], lambda b: b.norm, eqx.nn.LayerNorm(8, eps=1e-3))],
            r"layers\[4\]\.norm\.eps \(static\) is 0\.001, not 1e-05",
        ),
        "not a module": ([bs[0], jnp.sin], r"Got PjitFunction at layers\[1\]"),
    }


@pytest.mark.parametrize("case", list(_differing()), ids=str)
@pytest.mark.parametrize("fn", ["scan_layers", "Stacked"])
def test_error_names_the_first_differing_block(case, fn):
    bs, match = _differing()[case]
    x = jnp.ones(8)
    with pytest.raises(ValueError, match=f"^{fn} expected layers .*{match}"):
        if fn == "scan_layers":
            er.scan_layers(bs, x)
        else:
            er.Stacked(bs)


class Model(eqx.Module):
    """A user's model: no field named `checkpoint`; the blocks are a `Stacked`."""

    blocks: er.Stacked[Block]
    head: eqx.nn.Linear

    def __init__(self, *, key):
        bkey, hkey = jax.random.split(key)
        self.blocks = er.Stacked(blocks(depth=4, key=bkey))
        self.head = eqx.nn.Linear(8, 2, key=hkey)

    def __call__(self, x):
        return self.head(self.blocks(x))


def test_stacked_is_found_by_set_checkpoint_and_plan():
    model = Model(key=jax.random.key(0))
    assert "checkpoint" not in {f.name for f in dataclasses.fields(model)}
    switched = er.set_checkpoint([model, model], er.every(2))
    assert [m.blocks.checkpoint for m in switched] == [er.every(2)] * 2
    # The arrays are kept, not copied.
    assert switched[0].blocks.layers.linear.weight is model.blocks.layers.linear.weight

    loss = lambda m, x: jnp.sum(m(x) ** 2)
    x = jnp.ones(8)
    result = er.plan(
        eqx.filter_grad(loss), model, x, budget_bytes="1GiB", candidates=["nothing"]
    )
    assert result.checkpoint == "nothing"
    planned = result.apply(model)
    assert planned.blocks.checkpoint == "nothing"
    grads = [jtu.tree_leaves(eqx.filter_grad(loss)(m, x)) for m in (planned, model)]
    assert eqx.tree_equal(*grads, rtol=1e-5, atol=1e-6)


def test_stacked_under_vmap():
    model = Model(key=jax.random.key(0))
    model = er.set_checkpoint(model, er.recursive())
    xs = jax.random.normal(jax.random.key(1), (3, 8))
    want = jnp.stack([model.head(loop(model.blocks.unstacked(), x)) for x in xs])
    assert eqx.tree_equal(jax.vmap(model)(xs), want, rtol=1e-5, atol=1e-6)

    def loss(m):
        return jnp.sum(jax.vmap(m)(xs) ** 2)

    def loss_loop(tree):
        bs, head = tree
        return sum(jnp.sum(head(loop(bs, x)) ** 2) for x in xs)

    g = eqx.filter_grad(loss)(model)
    g_bs, g_head = eqx.filter_grad(loss_loop)((model.blocks.unstacked(), model.head))
    assert eqx.tree_equal(g.blocks.unstacked(), g_bs, rtol=1e-5, atol=1e-6)
    assert eqx.tree_equal(g.head, g_head, rtol=1e-5, atol=1e-6)


def test_stacked_from_keys_and_back():
    keys = jax.random.split(jax.random.key(0), 4)
    from_keys = er.Stacked(er.stack(lambda k: Block(8, key=k), keys), checkpoint="dots")
    from_list = er.Stacked([Block(8, key=k) for k in keys], checkpoint="dots")
    assert len(from_keys) == len(from_list) == 4
    assert eqx.tree_equal(from_keys.layers, from_list.layers, rtol=1e-5, atol=1e-6)
    assert eqx.tree_equal(
        from_list.unstacked(), [Block(8, key=k) for k in keys], rtol=1e-5, atol=1e-6
    )
    x = jnp.ones(8)
    assert eqx.tree_equal(from_keys(x), from_list(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        from_list.checkpoint = None  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(layers=[]), "^Stacked expected layers to be a non-empty list"),
        (dict(checkpoint="dot"), "^Stacked: checkpoint expected None, a policy"),
        (dict(unroll=0), "^Stacked: unroll must be an int >= 1. Got 0"),
        (
            dict(
                layers=eqx.tree_at(
                    lambda s: s.linear.bias,
                    er.stack(lambda k: Block(8, key=k), jax.random.split(KEY, 3)),
                    jnp.zeros((2, 8)),
                )
            ),
            r"^Stacked expected every array in layers to have the same leading "
            r"depth axis. Got depths \[2, 3\]",
        ),
    ],
    ids=["empty", "checkpoint", "unroll", "depths"],
)
def test_stacked_validation(kwargs, match):
    kwargs = dict(dict(layers=blocks(depth=2)), **kwargs)
    layers = kwargs.pop("layers")
    with pytest.raises(ValueError, match=match):
        er.Stacked(layers, **kwargs)


class Scale(eqx.Module):
    s: jax.Array

    def __call__(self, x):
        return x * self.s


def test_stacked_of_scalar_layers_is_not_taken_for_one_layer():
    """A stack of 4 layers holding one scalar each, on a carry of shape (4,),
    looks to `scan_layers` like one unstacked layer; a list, or a `Stacked`,
    says what it is."""
    layers = [Scale(jnp.asarray(1.0 + i)) for i in range(4)]
    x = jnp.ones(4)
    assert eqx.tree_equal(
        er.Stacked(layers, checkpoint="dots")(x), 24.0 * x, rtol=1e-5, atol=1e-6
    )
    assert eqx.tree_equal(er.scan_layers(layers, x), 24.0 * x, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="looks like a single layer"):
        er.scan_layers(er.Stacked(layers).layers, x)

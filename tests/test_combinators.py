"""A user's own model: a list or tuple of blocks under `scan_layers` and `chain`
(stacked once, no `lax.switch`), and `eqx_remat.Stacked` as one field of a model
with no `checkpoint` field of its own."""

import contextlib
import dataclasses
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import pytest
from helpers import count_primitive, needs_libtpu, temp_bytes

import eqx_remat as er
from eqx_remat import _combinators


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
# Where XLA runs a checkpoint in straight-line code as none (the CPU of jaxlib
# 0.10), a checkpointed list is stacked and scanned, and says so.
STACKS = jax.default_backend() == "cpu" and not _combinators.cpu_keeps_checkpoints()


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
    stacked = ck is not None and apply != "Stacked" and STACKS
    with _stacked_says_so(stacked):
        out = APPLY[apply](bs, x, ck)
        f = lambda bs, x: APPLY[apply](bs, x, ck)
        grads = jax.grad(loss, argnums=(0, 1))(bs, x, f)
    assert eqx.tree_equal(out, loop(bs, x), rtol=1e-5, atol=1e-6)
    want = jax.grad(loss, argnums=(0, 1))(bs, x, loop)
    assert type(grads[0]) is container
    assert eqx.tree_equal(grads, want, rtol=1e-5, atol=1e-6)


def test_list_of_blocks_with_per_layer_inputs():
    bs, x = blocks(), jnp.linspace(-1.0, 1.0, 8)
    ts = jnp.linspace(0.9, 1.1, len(bs))
    want = x
    for b, t in zip(bs, ts):
        want = b(want, t)
    assert eqx.tree_equal(er.scan_layers(bs, x, ts), want, rtol=1e-5, atol=1e-6)
    with _stacked_says_so():
        got = er.scan_layers(bs, x, ts, checkpoint="dots")
    assert eqx.tree_equal(got, want, rtol=1e-5, atol=1e-6)
    assert eqx.tree_equal(
        er.Stacked(bs, checkpoint=er.every(2))(x, ts), want, rtol=1e-5, atol=1e-6
    )


def _stack_by_hand(bs):
    params = [eqx.filter(b, eqx.is_array) for b in bs]
    stacked = jtu.tree_map(lambda *xs: jnp.stack(xs), *params)
    return eqx.combine(stacked, eqx.filter(bs[0], eqx.is_array, inverse=True))


@contextlib.contextmanager
def _stacked_says_so(stacked: bool = STACKS):
    """Where the list is `stacked`, the `StackedListWarning` that says so;
    elsewhere, none (raised as an error)."""
    if stacked:
        with pytest.warns(
            er.StackedListWarning,
            match=r"on the cpu, XLA runs a checkpoint on a list of layers as none, "
            r"so the list of \d+ layers is stacked .* "
            r"eqx_remat\.Stacked\((layers|fns)\)",
        ):
            yield
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", er.StackedListWarning)
            yield


IN_PLACE = [
    None,
    "dots",
    "nothing",
    er.every(2),
    er.every(2, policy="dots"),
    er.nested(2),
    er.recursive(),
    er.nested(2, policy="nothing"),
    er.binomial(1),
    er.binomial(2),
    er.binomial(3, policy="dots"),
    er.ranges((2, "dots"), (3, er.recursive())),
    er.ranges((1, None), (2, er.binomial(2)), (2, "nothing")),
]


@pytest.mark.parametrize("ck", IN_PLACE, ids=str)
def test_a_list_in_place_matches_the_python_loop(ck):
    """The in-place path (here called directly): equal outputs and gradients to
    the Python loop, per-layer inputs included, under `jit`, for every policy
    and schedule. In float64, where a wrong gradient cannot hide in rounding:
    in float32 a checkpoint that acts changes XLA's fusions, and on a GPU the
    gradients then differ from the loop's by up to 9e-5 (relative)."""

    def looped(bs, x, ts):
        for b, t in zip(bs, ts):
            x = b(x, t)
        return jnp.sum(x**2)

    def in_place(bs, x, ts):
        return jnp.sum(_combinators._scan_list(bs, x, ts, ck) ** 2)

    f64 = lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a
    with jax.enable_x64(True):
        bs = jtu.tree_map(f64, blocks())
        x, ts = jnp.linspace(-1.0, 1.0, 8), jnp.linspace(0.9, 1.1, len(bs))
        got = jax.jit(jax.value_and_grad(in_place, argnums=(0, 1)))(bs, x, ts)
        want = jax.value_and_grad(looped, argnums=(0, 1))(bs, x, ts)
        assert x.dtype == jnp.float64
        assert eqx.tree_equal(got, want, rtol=1e-12, atol=1e-14)


def _temps(bs, x, ck, target=None):
    """Temp bytes of the gradient over the list in place, stacked by hand inside
    the step, and passed in stacked."""
    grad = lambda f: eqx.filter_grad(lambda bs, x: jnp.sum(f(bs, x) ** 2))
    scan = lambda bs, x: er.scan_layers(bs, x, checkpoint=ck)
    temp = lambda f, *a: er.memory_report(f, *a, target=target).temp_bytes
    return (
        temp(grad(scan), bs, x),
        temp(grad(lambda bs, x: scan(_stack_by_hand(bs), x)), bs, x),
        temp(grad(scan), jax.eval_shape(_stack_by_hand, bs), x),
    )


class Wide(eqx.Module):
    """The issue's block: width -> 4 x width -> width, on a batch of rows."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width, *, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(width, 4 * width, key=k1)
        self.down = eqx.nn.Linear(4 * width, width, key=k2)

    def __call__(self, x):
        return x + jax.vmap(lambda v: self.down(jax.nn.gelu(self.up(v))))(x)


def _wide(depth, width, abstract=False):
    make = lambda: [Wide(width, key=k) for k in jax.random.split(KEY, depth)]
    bs = eqx.filter_eval_shape(make) if abstract else make()
    layer = sum(p.size * p.dtype.itemsize for p in jtu.tree_leaves(bs[0]))
    return bs, layer


def test_a_list_without_checkpoint_costs_less_than_its_stack():
    """Six blocks 64 -> 256 -> 64 on 8 rows (parameter-dominated): without
    checkpoint, the list runs in place on every platform, here the CPU, and
    needs no more than the same blocks passed in stacked, plus one layer;
    stacking them inside the step (what a list cost before) needs more than
    both."""
    bs, layer = _wide(6, 64)
    in_place, by_hand, prestacked = _temps(bs, jnp.ones((8, 64)), None)
    assert in_place <= prestacked + layer, (in_place, prestacked, layer)
    assert in_place < by_hand, (in_place, by_hand)


@pytest.mark.parametrize(
    "ck", ["dots", pytest.param(er.every(2), marks=pytest.mark.heavy)]
)
def test_a_checkpointed_list_is_stacked_where_checkpoints_do_nothing(ck):
    """Where checkpoints in straight-line code do nothing (the CPU of jaxlib
    0.10), a checkpointed list is stacked, with a warning: it compiles to
    what stacking by hand does (±2%).
    Elsewhere it runs in place, silently, in less than stacking by hand. No
    branch per block is kept either way."""
    bs, x = blocks(depth=6, width=64), jnp.ones(64)
    with _stacked_says_so():
        in_place, by_hand, _ = _temps(bs, x, ck)
    if STACKS:
        assert abs(in_place - by_hand) <= 0.02 * by_hand, (in_place, by_hand)
    else:
        assert in_place < by_hand, (in_place, by_hand)
    grad = jax.grad(lambda bs, x: jnp.sum(er.chain(bs, checkpoint=ck)(x) ** 2))
    with _stacked_says_so():
        jaxpr = jax.make_jaxpr(grad)(bs, x)
    assert count_primitive(jaxpr.jaxpr, "cond", weighted=False) == 0


def test_checkpoints_in_straight_line_code_act_where_the_rule_says():
    """The XLA behaviour the rule above rests on: eight layers checkpointed one
    by one, unrolled, compile to the temp memory of no checkpoint at all on
    the CPU of jaxlib 0.10 (`cpu_keeps_checkpoints`), and to less elsewhere
    (jaxlib 0.11.2's CPU, an H200)."""

    def layer(w, x):
        return jnp.tanh(jnp.sin(x @ w) * 2.0 + 1.0)

    def loss(ws, x, checkpoint):
        for w in ws:
            x = jax.checkpoint(layer)(w, x) if checkpoint else layer(w, x)
        return jnp.sum(x)

    ws, x = [jnp.ones((64, 64))] * 8, jnp.ones((512, 64))
    plain = temp_bytes(jax.grad(lambda ws, x: loss(ws, x, False)), ws, x)
    remat = temp_bytes(jax.grad(lambda ws, x: loss(ws, x, True)), ws, x)
    assert plain > 8 * x.nbytes
    assert remat == plain if STACKS else remat < plain, (remat, plain)


@needs_libtpu
@pytest.mark.heavy
@pytest.mark.parametrize(
    "ck",
    [
        None,
        "dots",
        er.every(2),
        er.recursive(),
        er.binomial(2),
        er.ranges((2, "dots"), (2, er.recursive())),
    ],
    ids=str,
)
def test_a_list_in_place_on_v5e_costs_at_most_its_stack_and_one_layer(ck):
    """Compiled for TPU v5e, where checkpoints in straight-line code act: four
    blocks 1024 -> 4096 -> 1024 (32 MiB of parameters each) on 8 rows, the
    list in place needs at most the blocks passed in stacked plus one layer,
    and less than stacking them inside the step (two copies: the stack and
    its gradient)."""
    bs, layer = _wide(4, 1024, abstract=True)
    x = jax.ShapeDtypeStruct((8, 1024), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", er.ReplicatedArgumentsWarning)
        in_place, by_hand, prestacked = _temps(bs, x, ck, target="v5e:1x1")
    assert in_place <= prestacked + layer, (in_place, prestacked, layer)
    assert in_place + layer < by_hand, (in_place, by_hand)


@needs_libtpu
def test_a_schedule_of_your_own_is_stacked_off_the_cpu_and_says_so():
    """A schedule without `unrolled` cannot run a list in place: compiled for
    v5e, the list is stacked, with the warning that names it."""
    from eqx_remat._schedules._unrolled import unrolls

    @dataclasses.dataclass(frozen=True)
    class whole(er.Schedule):
        policy: object = None

        def forward(self, layers, carry):
            return layers.run(carry, 0, layers.depth), carry

        def backward(self, layers, saved, cts):
            return layers.reverse_segment(0, layers.depth, saved, cts)

        def evaluations(self, depth):
            return 2 * depth

    assert unrolls(er.every(2)) and unrolls("dots") and not unrolls(whole())
    bs, x = blocks(depth=3), jax.ShapeDtypeStruct((8,), jnp.float32)
    grad = eqx.filter_grad(
        lambda bs, x: jnp.sum(er.scan_layers(bs, x, checkpoint=whole()) ** 2)
    )
    with pytest.warns(
        er.StackedListWarning, match=r"whole\(policy=None\) has no `unrolled` method"
    ):
        er.memory_report(grad, bs, x, target="v5e:1x1")


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

"""zoo.MLP and zoo.ResidualChain: gradients under every policy and schedule, bad
input, set_checkpoint. (The Transformer is in test_transformer.py.)"""

import dataclasses
import functools

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import raises_bad_input, temp_bytes
from hypothesis import given
from zoo_helpers import build, quick_jit

import eqx_remat as er
import zoo


# Every policy name, a policy callable, name policies (on each tag: the layer
# input, which a checkpointed layer keeps anyway, and `linear`), and every
# schedule, with and without inner policies, with uneven splits.
CHECKPOINTS = [
    *sorted(er.POLICIES),
    jax.checkpoint_policies.dots_saveable,
    er.save_names("layer_input"),
    er.save_all_but_names("layer_input"),
    er.save_names("linear"),
    er.save_all_but_names("linear"),
    er.every(1),
    er.every(2),
    er.every(3, policy="dots"),
    er.every(100, policy="nothing"),
    er.nested(1),
    er.nested(2),
    er.nested(3),
    er.nested(2, policy="dots_no_batch"),
    er.recursive(),
]
if hasattr(er, "binomial"):
    CHECKPOINTS += [er.binomial(2), er.binomial(3, policy="nothing")]


def ck_id(ck) -> str:
    return getattr(ck, "__name__", None) or str(ck)


def _loss(model, x):
    return jnp.mean(jnp.sin(jax.vmap(model)(x)))


# One cache for every test: filter_jit keys on the static fields (the checkpoint
# included), so each (shape, checkpoint) pair compiles once.
_grads = quick_jit(eqx.filter_grad(_loss))
_outputs = quick_jit(lambda m, x: jax.vmap(m)(x))


def assert_same_gradients(model, x, ck, *, rtol=1e-5):
    ref = _grads(er.set_checkpoint(model, None), x)
    # Gradients are models: compare them with the same (static) checkpoint.
    got = er.set_checkpoint(_grads(er.set_checkpoint(model, ck), x), None)
    # atol relative to the largest gradient: entries near zero are differences
    # of O(1) terms, so rtol alone would be too strict for them.
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref))
    assert eqx.tree_equal(got, ref, rtol=rtol, atol=rtol * scale), ck_id(ck)


def mlp(depth=3, *, in_size=3, out_size=2, width=5, seed=0, **kwargs):
    return zoo.MLP(in_size, out_size, width, depth, key=jr.key(seed), **kwargs)


def chain(depth=5, *, width=4, seed=0, **kwargs):
    return zoo.ResidualChain(width, depth, key=jr.key(seed), **kwargs)


# --- gradients equal the un-checkpointed model's ------------------------------


# Policies on the MLP, schedules on the ResidualChain (their showcase); the
# property test below draws any checkpoint for either model.
POLICY_CHECKPOINTS = [c for c in CHECKPOINTS if not isinstance(c, er.Schedule)]
SCHEDULE_CHECKPOINTS = [c for c in CHECKPOINTS if isinstance(c, er.Schedule)]


@pytest.mark.parametrize(
    "ck",
    [
        pytest.param(ck, marks=pytest.mark.heavy)
        if ck == "offload_dots_no_batch"
        else ck
        for ck in POLICY_CHECKPOINTS
    ],
    ids=ck_id,
)
def test_mlp_gradients(ck):
    x = jr.normal(jr.key(1), (2, 3))
    assert_same_gradients(mlp(), x, ck)


@pytest.mark.parametrize("ck", SCHEDULE_CHECKPOINTS, ids=ck_id)
def test_residual_chain_gradients(ck):
    x = jr.normal(jr.key(1), (2, 4))
    assert_same_gradients(chain(), x, ck)


@pytest.mark.heavy
@given(
    kind=st.sampled_from(["MLP", "ResidualChain"]),
    in_size=st.integers(1, 4),
    out_size=st.integers(1, 3),
    width=st.integers(1, 6),
    depth=st.integers(1, 12),
    batch=st.integers(1, 3),
    ck=st.sampled_from(CHECKPOINTS),
    seed=st.integers(0, 2**16),
)
def test_gradients_property(kind, in_size, out_size, width, depth, batch, ck, seed):
    # Initialised under one jit: new shapes compile once rather than op by op.
    if kind == "MLP":
        model = build(zoo.MLP, in_size, out_size, width, depth, key=jr.key(seed))
    else:
        model = build(zoo.ResidualChain, width, depth, key=jr.key(seed))
        in_size = out_size = width
    x = jr.normal(jr.key(seed + 1), (batch, in_size))
    assert_same_gradients(model, x, ck)


@pytest.mark.parametrize(
    "kwargs, activation",
    [({}, jax.nn.gelu), ({"activation": jax.nn.relu}, jax.nn.relu)],
    ids=["gelu", "relu"],
)
def test_mlp_is_the_documented_network(kwargs, activation):
    """`depth` counts the scanned hidden layers: depth + 2 linear layers in all."""
    model = mlp(4, in_size=3, out_size=2, width=5, **kwargs)
    assert model.layer_in.weight.shape == (5, 3)
    assert model.hidden.linear.weight.shape == (4, 5, 5)
    assert model.layer_out.weight.shape == (2, 5)
    x = jr.normal(jr.key(1), (1, 3))
    h = activation(model.layer_in(x[0]))
    for i in range(4):
        h = activation(jax.tree.map(lambda a: a[i], model.hidden.linear)(h))
    expected = model.layer_out(h)
    assert jnp.allclose(_outputs(model, x)[0], expected, rtol=1e-5, atol=1e-6)


# --- ResidualChain at depth in the thousands ----------------------------------


def test_residual_chain_deep_is_tame():
    """The 1/depth step keeps outputs and gradients O(1) at any depth."""
    model = chain(2000)
    x = jr.normal(jr.key(1), (2, 4))
    y = _outputs(model, x)
    assert jnp.all(jnp.isfinite(y))
    # Each layer moves each coordinate by at most 1/depth.
    assert float(jnp.max(jnp.abs(y - x))) <= 1.0 + 1e-4
    g = _grads(model, x)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(g))
    # The input-output Jacobian is a product of 2000 near-identity factors.
    jac = jax.jacrev(model)(x[0])
    assert 0.2 < float(jnp.min(jnp.linalg.svd(jac, compute_uv=False)))
    assert float(jnp.max(jnp.linalg.svd(jac, compute_uv=False))) < 5


@pytest.mark.parametrize(
    "ck",
    [er.recursive(), er.nested(3), er.every(45, policy="nothing")]
    + ([er.binomial(8)] if hasattr(er, "binomial") else []),
    ids=ck_id,
)
def test_residual_chain_deep_gradients(ck):
    x = jr.normal(jr.key(1), (2, 4))
    assert_same_gradients(chain(2000), x, ck)


@pytest.mark.heavy
def test_residual_chain_recursive_saves_memory():
    """D = 1024: bisection keeps O(log D) carries instead of D layers' residuals."""
    x = jnp.zeros((4, 64))

    def temp(model):
        grad = jax.grad(lambda p: _loss(eqx.combine(p, static(model)), x))
        return temp_bytes(grad, arrays(model))

    model = chain(1024, width=64)
    assert temp(er.set_checkpoint(model, er.recursive())) < 0.2 * temp(model)


def arrays(model):
    return eqx.filter(model, eqx.is_array)


def static(model):
    return eqx.filter(model, eqx.is_array, inverse=True)


# --- set_checkpoint ------------------------------------------------------------


@pytest.mark.parametrize(
    "make, size", [(mlp, 3), (chain, 4)], ids=["MLP", "ResidualChain"]
)
def test_set_checkpoint_switches_schedule(make, size):
    model = make()
    x = jr.normal(jr.key(1), (2, size))
    assert model.checkpoint is None
    for ck in ("dots", er.recursive(), er.every(2, policy="nothing")):
        switched = er.set_checkpoint(model, ck)
        assert switched.checkpoint == ck
        assert type(switched) is type(model)
        # Same weights (the very same arrays), only the schedule differs.
        for a, b in zip(
            jax.tree.leaves(arrays(model)), jax.tree.leaves(arrays(switched))
        ):
            assert a is b
        g = er.set_checkpoint(_grads(switched, x), None)
        assert eqx.tree_equal(g, _grads(model, x), rtol=1e-5, atol=1e-6)
    back = er.set_checkpoint(er.set_checkpoint(model, er.recursive()), None)
    assert back.checkpoint is None


def test_checkpoint_in_constructor():
    model = mlp(checkpoint=er.recursive())
    assert model.checkpoint == er.recursive()
    assert chain(checkpoint="dots").checkpoint == "dots"


# --- bad input -----------------------------------------------------------------


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: mlp(0), "depth"),
        (lambda: mlp(width=0), "width_size"),
        (lambda: mlp(in_size=0), "in_size"),
        (lambda: chain(0), "depth"),
        (lambda: chain(width=0), "width"),
    ],
    ids=["mlp-depth0", "mlp-width0", "mlp-in0", "chain-depth0", "chain-width0"],
)
def test_bad_sizes(make, arg):
    with pytest.raises(ValueError, match=rf"{arg} must be an int >= 1\. Got"):
        make()


@pytest.mark.parametrize("make", [mlp, chain], ids=["MLP", "ResidualChain"])
def test_bad_checkpoint(make):
    # A float depth: beartype (under pytest's jaxtyping hook) or our own check.
    with pytest.raises((TypeError, ValueError), match="depth"):
        make(2.0)
    with pytest.raises(ValueError, match="Unknown policy 'dotz'.*'dots'"):
        make(checkpoint="dotz")
    with pytest.raises((TypeError, ValueError), match="checkpoint"):
        make(checkpoint=3)


# Every integer argument of every zoo constructor, with a valid value.
INT_ARGS = {
    "MLP": (
        zoo.MLP,
        {"in_size": 2, "out_size": 3, "width_size": 4, "depth": 2, "unroll": 2},
    ),
    "ResidualChain": (zoo.ResidualChain, {"width": 3, "depth": 2, "unroll": 2}),
    "Transformer": (
        zoo.Transformer,
        {
            "vocab_size": 16,
            "max_len": 8,
            "d_model": 8,
            "num_heads": 2,
            "num_layers": 2,
            "d_ff": 12,
            "num_kv_heads": 1,
            "unroll": 2,
        },
    ),
    # Its defaults (d_ff, num_kv_heads) are computed from d_model and num_heads.
    "Transformer.llama": (
        zoo.Transformer.llama,
        {
            "vocab_size": 16,
            "max_len": 8,
            "d_model": 8,
            "num_heads": 4,
            "num_layers": 2,
            "unroll": 2,
        },
    ),
    "Dense": (zoo.Dense, {"in_size": 2, "out_size": 3}),
}
INT_CASES = [(model, arg) for model, (_, kwargs) in INT_ARGS.items() for arg in kwargs]
_HEAVY_INT_CASE = ("Transformer", "vocab_size", np.int64)


def _static_values(module):
    """The values of the static fields of `module` and of the modules inside it."""
    out = []
    for f in dataclasses.fields(module):
        value = getattr(module, f.name)
        if f.metadata.get("static", False):
            out.append((f.name, value))
        for sub in jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, eqx.Module)):
            if isinstance(sub, eqx.Module):
                out += _static_values(sub)
    return out


@pytest.mark.parametrize(
    "model, arg, to",
    [
        pytest.param(
            model,
            arg,
            to,
            id=f"{model}-{arg}-{name}",
            # The one slow case (a Transformer built twice) runs with -m heavy.
            marks=[pytest.mark.heavy] if (model, arg, to) == _HEAVY_INT_CASE else [],
        )
        for to, name in [(np.int64, "np.int64"), (jnp.int32, "jnp.int32")]
        for model, arg in INT_CASES
    ],
)
def test_integer_arguments_take_any_integer_type(model, arg, to):
    # A NumPy or JAX integer (what config loaders produce) builds the model that
    # the Python int builds, stored as an int: no "JAX array set as static"
    # warning (pytest turns warnings into errors).
    make, kwargs = INT_ARGS[model]
    got = make(**{**kwargs, arg: to(kwargs[arg])}, key=jr.key(0))
    want = make(**kwargs, key=jr.key(0))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for name, value in _static_values(got):
        assert not isinstance(value, (np.generic, jax.Array)), (name, type(value))
    if model != "Dense":  # (a Dense stores its sizes as its weight's shape)
        assert type(getattr(got, arg)) is int
        assert getattr(got, arg) == kwargs[arg]
    arrays = [jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (got, want)]
    assert eqx.tree_equal(*arrays, rtol=0, atol=0)


# bool is an integer type but no size: rejected (except `unroll=True`, the whole
# stack); a float is rejected by beartype under pytest's jaxtyping hook, by our
# own check otherwise; both name the argument.
BAD_INTS = [(m, a, True) for m, a in INT_CASES if a != "unroll"] + [
    (m, a, 2.0) for m, a in INT_CASES
]


@pytest.mark.parametrize(
    "model, arg, bad",
    BAD_INTS,
    ids=[f"{m}-{a}-{type(b).__name__}" for m, a, b in BAD_INTS],
)
def test_integer_arguments_reject_bool_and_float(model, arg, bad):
    make, kwargs = INT_ARGS[model]
    match = rf"{arg} must be an int >= 1\. Got {bad!r} of type|parameter '{arg}'"
    error = ValueError if isinstance(bad, bool) else (TypeError, ValueError)
    with pytest.raises(error, match=match):
        make(**{**kwargs, arg: bad}, key=jr.key(0))


@pytest.mark.parametrize("to", [np.int64, jnp.int32], ids=["np.int64", "jnp.int32"])
def test_scan_layers_unroll_takes_any_integer_type(to):
    model = mlp()
    x = jnp.ones(model.width_size)
    want = er.scan_layers(model.hidden, x, unroll=2)
    got = er.scan_layers(model.hidden, x, unroll=to(2))
    got_ck = er.scan_layers(model.hidden, x, checkpoint=er.recursive(), unroll=to(2))
    assert eqx.tree_equal(got, want, rtol=0, atol=0)
    assert eqx.tree_equal(got_ck, want, rtol=1e-6, atol=1e-6)


def test_zoo_models_state_the_contract():
    # Every zoo model is a zoo.AbstractModel, whose __check_init__ validates
    # `checkpoint` and `unroll` with the model's name.
    for cls in (zoo.MLP, zoo.ResidualChain, zoo.Transformer):
        assert issubclass(cls, zoo.AbstractModel)
        assert isinstance(cls.ACTIVATION_NAMES, tuple)
    assert mlp().activation_names == zoo.MLP.ACTIVATION_NAMES

    class Incomplete(zoo.AbstractModel):
        checkpoint: er.Checkpoint = eqx.field(static=True)
        unroll: int = eqx.field(static=True)

    with pytest.raises(TypeError, match="ACTIVATION_NAMES"):
        Incomplete(None, 1)

    class Tiny(zoo.AbstractModel):
        ACTIVATION_NAMES = ()
        checkpoint: er.Checkpoint = eqx.field(static=True)
        unroll: int | bool = eqx.field(static=True)

    assert Tiny(er.recursive(), True).unroll is True
    with pytest.raises(ValueError, match="Tiny: checkpoint.*Unknown policy 'dotz'"):
        Tiny("dotz", 1)
    with pytest.raises(ValueError, match=r"Tiny: unroll must be an int >= 1\. Got 0"):
        Tiny(None, 0)


def test_mlp_activation_must_be_callable():
    with raises_bad_input("activation must be a callable", param="activation"):
        zoo.MLP(2, 2, 4, 1, activation="relu", key=jax.random.key(0))  # pyright: ignore[reportArgumentType]


def test_mlp_bad_input():
    model = mlp(in_size=3)
    with pytest.raises(
        ValueError, match=r"MLP expected x of shape \(3,\)\. Got \(4,\)"
    ):
        model(jnp.zeros(4))
    # Wrong rank or dtype: jaxtyping + beartype name the argument, at trace time.
    with pytest.raises(TypeError, match="parameter 'x'"):
        eqx.filter_eval_shape(model, jnp.zeros((2, 3)))
    with pytest.raises(TypeError, match="parameter 'x'"):
        eqx.filter_eval_shape(model, jnp.zeros(3, dtype=jnp.int32))


def test_residual_chain_bad_input():
    model = chain(width=4)
    with pytest.raises(ValueError, match=r"expected x of shape \(4,\)\. Got \(3,\)"):
        model(jnp.zeros(3))
    with pytest.raises(TypeError, match="parameter 'x'"):
        eqx.filter_eval_shape(model, jnp.zeros((2, 4)))


# --- save_all_but_names saves less than "everything" on every model -----------

# Per model: a small instance, one input, and the tags whose value (or a view of
# it) is saved under "everything" — excluding those must save strictly less.
# The others are not saved under "everything" (a layer's input is the
# checkpoint's argument, kept whatever the policy; an output only added to the
# residual stream is not needed by the backward pass), so excluding them
# changes nothing, and must never save more.
_TF = dict(vocab_size=16, max_len=8, d_model=8, num_heads=2, num_layers=2)
EXCLUSION_MODELS = {
    "MLP": (
        lambda ck: zoo.MLP(4, 3, 16, 2, checkpoint=ck, key=jr.key(0)),
        jnp.ones(4),
        {"linear"},
    ),
    "ResidualChain": (
        lambda ck: zoo.ResidualChain(16, 2, checkpoint=ck, key=jr.key(0)),
        jnp.ones(16),
        set(),
    ),
    "Transformer": (
        lambda ck: build(zoo.Transformer, **_TF, checkpoint=ck, key=jr.key(0)),
        jnp.arange(8) % 16,
        {"qkv_proj", "attention_context", "mlp_hidden"},
    ),
}
EXCLUSIONS = [
    (model, tag, tag in strict)
    for model, (make, _, strict) in EXCLUSION_MODELS.items()
    for tag in getattr(zoo, model).ACTIVATION_NAMES
]
# Compiling the Transformer's gradient takes ~10 s a tag on two cores: one strict
# and one non-strict tag run with -m heavy, the rest with -m slow.
_FAST = {"qkv_proj", "out_proj"}
MEMORY_EXCLUSIONS = [
    pytest.param(
        *e,
        id=f"{e[0]}-{e[1]}",
        marks=(
            [pytest.mark.heavy]
            if e[0] == "Transformer" and e[1] in _FAST
            else [pytest.mark.slow]
            if e[0] == "Transformer"
            else []
        ),
    )
    for e in EXCLUSIONS
]


def _model_loss(model, x):
    return jnp.sum(jnp.sin(model(x)))


_model_grads = quick_jit(eqx.filter_grad(_model_loss))


def _residual_bytes(model, x):
    return sum(r.nbytes for r in er.residuals(_model_loss, model, x))


@functools.cache
def _everything(model: str, what: str) -> int:
    make, x, _ = EXCLUSION_MODELS[model]
    if what == "residuals":
        return _residual_bytes(make("everything"), x)
    grad = eqx.filter_grad(_model_loss)
    return er.memory_report(grad, make("everything"), x).temp_bytes


def test_exclusion_table_covers_every_tag():
    for model, (_, _, strict) in EXCLUSION_MODELS.items():
        assert strict <= set(getattr(zoo, model).ACTIVATION_NAMES), model


@pytest.mark.parametrize(
    "model, tag, strict", EXCLUSIONS, ids=[f"{m}-{t}" for m, t, _ in EXCLUSIONS]
)
def test_save_all_but_names_residual_bytes(model, tag, strict):
    make, x, _ = EXCLUSION_MODELS[model]
    everything = _everything(model, "residuals")
    excluded = _residual_bytes(make(er.save_all_but_names(tag)), x)
    if strict:
        assert excluded < everything, (tag, excluded, everything)
    else:
        assert excluded <= everything, (tag, excluded, everything)
    if model == "Transformer":
        return  # its gradients under name policies: test_transformer.py
    # Gradients do not change.
    m = make(None)
    ref = _model_grads(m, x)
    got = _model_grads(er.set_checkpoint(m, er.save_all_but_names(tag)), x)
    arrays = lambda m: eqx.filter(er.set_checkpoint(m, None), eqx.is_array)
    assert eqx.tree_equal(arrays(got), arrays(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model, tag, strict", MEMORY_EXCLUSIONS)
def test_save_all_but_names_compiled_memory(model, tag, strict):
    make, x, _ = EXCLUSION_MODELS[model]
    grad = eqx.filter_grad(_model_loss)
    everything = _everything(model, "memory")
    excluded = er.memory_report(grad, make(er.save_all_but_names(tag)), x).temp_bytes
    if strict:
        assert excluded < everything, (tag, excluded, everything)
    else:
        assert excluded <= everything, (tag, excluded, everything)


def test_save_all_but_names_under_vmap():
    # Per-example models batched with jax.vmap: the exclusion still applies.
    make, x, _ = EXCLUSION_MODELS["MLP"]
    xs = jnp.stack([x, 2 * x])

    def loss(model, xs):
        return jnp.sum(jax.vmap(model)(xs))

    def nbytes(ck):
        return sum(r.nbytes for r in er.residuals(loss, make(ck), xs))

    assert nbytes(er.save_all_but_names("linear")) < nbytes("everything")


# --- no silent no-ops ----------------------------------------------------------


@pytest.mark.parametrize("model", ["MLP", "ResidualChain"])
def test_every_documented_tag_changes_what_save_names_keeps(model):
    """A model tags only values a name policy can act on: saving each tag keeps
    more than `"nothing"`, a value tagged with it. (ResidualChain tagged
    `tanh(h)`, whose derivative reads `tanh`'s own output: `save_names("tanh")`
    kept exactly what `"nothing"` keeps.) A name it does not tag is an error."""
    make, x, _ = EXCLUSION_MODELS[model]

    def kept(ck):
        return sorted(
            (r.shape, str(r.dtype), r.name or "")
            for r in er.residuals(_model_loss, make(ck), x)
        )

    nothing = kept("nothing")
    for tag in getattr(zoo, model).ACTIVATION_NAMES:
        more = [r for r in kept(er.save_names(tag)) if r not in nothing]
        assert [r[2] for r in more] == [tag], (tag, more)
    for pol in (er.save_names("tanh"), er.offload_names("tanh")):
        with pytest.raises(ValueError, match="'tanh', which tags nothing"):
            er.residuals(_model_loss, make(pol), x)


@pytest.mark.parametrize(
    "tree",
    [eqx.nn.Linear(2, 2, key=jr.key(0)), {"w": jnp.ones(3)}, None],
    ids=["Linear", "dict", "None"],
)
def test_set_checkpoint_without_a_checkpoint_field_raises(tree):
    with pytest.raises(ValueError, match="set_checkpoint expected a pytree containing"):
        er.set_checkpoint(tree, er.every(2))


def test_scan_layers_catches_a_layer_that_was_never_stacked():
    x = jnp.ones(4)
    with pytest.raises(ValueError, match="never stacked"):
        er.scan_layers(eqx.nn.LayerNorm(4), x)
    # A Linear's slices map the carry to a scalar: the carry check says so.
    with pytest.raises(ValueError, match="eqx_remat.stack"):
        er.scan_layers(eqx.nn.Linear(4, 4, key=jr.key(0)), x)
    # The same LayerNorm stacked is fine.
    norms = er.stack(lambda k: eqx.nn.LayerNorm(4), jr.split(jr.key(0), 3))
    assert er.scan_layers(norms, x).shape == (4,)


def test_switching_checkpoint_mid_training_covers_the_optimiser_state():
    import optax

    model = mlp(depth=2, checkpoint=None)
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    optim = optax.adam(1e-2)
    with jax.numpy_dtype_promotion("standard"):
        opt_state = optim.init(eqx.filter(model, eqx.is_array))

    def step(model, opt_state):
        grads = _grads(model, x)
        # optax mixes its int32 step count with floats.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optim.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state

    model, opt_state = step(model, opt_state)
    # The optimiser state holds copies of the model's modules, static checkpoint
    # included: switching the model alone leaves mismatched structures.
    switched = er.set_checkpoint(model, "nothing")
    with pytest.raises(ValueError):
        step(switched, opt_state)
    # One call switches both, and training goes on with the same numbers as
    # without switching.
    model2, opt_state2 = er.set_checkpoint((model, opt_state), "nothing")
    got, _ = step(model2, opt_state2)
    ref, _ = step(model, opt_state)
    assert got.checkpoint == "nothing"
    arrays = lambda m: eqx.filter(er.set_checkpoint(m, None), eqx.is_array)
    assert eqx.tree_equal(arrays(got), arrays(ref), rtol=1e-5, atol=1e-6)


UNROLL_MODELS = {
    "MLP": (lambda **kw: zoo.MLP(3, 2, 8, 4, key=jr.key(0), **kw), jnp.ones(3)),
    "ResidualChain": (
        lambda **kw: zoo.ResidualChain(4, 5, key=jr.key(0), **kw),
        jnp.ones(4),
    ),
    "Transformer": (
        lambda **kw: zoo.Transformer(16, 8, 8, 2, 3, key=jr.key(0), **kw),
        jnp.arange(6, dtype=jnp.int32),
    ),
}
# The slowest combinations run with -m heavy.
_HEAVY_UNROLL = {
    "None": {"MLP", "Transformer"},
    "dots": {"MLP", "Transformer"},
    "recursive(policy=None)": {"Transformer"},
}


@pytest.mark.parametrize(
    "ck, make, x",
    [
        pytest.param(
            ck,
            *UNROLL_MODELS[name],
            id=f"{ck}-{name}",
            marks=[pytest.mark.heavy] if name in _HEAVY_UNROLL[str(ck)] else [],
        )
        for name in UNROLL_MODELS
        for ck in [None, "dots", er.recursive()]
    ],
)
def test_unroll_keeps_gradients(ck, make, x):
    def grads(unroll):
        model = make(checkpoint=ck, unroll=unroll)
        assert model.unroll == unroll
        return eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)

    ref = jax.tree.leaves(grads(1))
    for unroll in (2, True):
        assert eqx.tree_equal(jax.tree.leaves(grads(unroll)), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="unroll must be an int >= 1"):
        make(unroll=0)

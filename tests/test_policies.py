import importlib.util
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import jax_remat3
from jax.ad_checkpoint import checkpoint_name

import eqx_remat as er
import zoo


def test_policies_mapping():
    assert {
        "everything",
        "nothing",
        "dots",
        "dots_no_batch",
        "offload_dots_no_batch",
    } <= set(er.POLICIES)
    with pytest.raises(TypeError):
        er.POLICIES["mine"] = jax.checkpoint_policies.nothing_saveable  # type: ignore


def test_policy_normalises():
    assert er.policy(None) is None
    assert er.policy("dots") is jax.checkpoint_policies.dots_saveable
    p = er.save_names("a")
    assert er.policy(p) is p


def test_policy_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="Unknown policy 'dot'.*'dots'.*'nothing'"):
        er.policy("dot")


@pytest.mark.parametrize("bad", [3, int, ["dots"]], ids=["int", "type", "list"])
def test_policy_bad_type(bad):
    with pytest.raises(ValueError, match="policy expected None, a policy name"):
        er.policy(bad)


@pytest.mark.parametrize(
    "bad",
    [jnp.sin, print, lambda: True, lambda prim: True],
    ids=["jnp.sin", "print", "no-argument", "one-argument"],
)
def test_a_callable_jax_cannot_call_as_a_policy_is_refused(bad):
    # It was accepted, then failed inside JAX's partial evaluation ("Error
    # interpreting argument to sin as an abstract array").
    with pytest.raises(ValueError, match=r"policy\(primitive, \*avals, \*\*params\)"):
        er.policy(bad)
    with pytest.raises(ValueError, match="Transformer: checkpoint expected"):
        zoo.Transformer(16, 8, 8, 2, 1, checkpoint=bad, key=jax.random.key(0))
    with pytest.raises(ValueError, match="every: invalid policy"):
        er.every(2, bad)


def test_policies_of_any_signature_jax_can_call_are_accepted():
    accepted = [
        jax.checkpoint_policies.nothing_saveable,
        jax.checkpoint_policies.save_only_these_names("a"),
        lambda prim, *avals, **params: True,
        lambda *_, **__: False,
    ]
    for p in accepted:
        assert er.policy(p) is p


@pytest.mark.parametrize(
    "make",
    [er.save_names, er.save_all_but_names, er.offload_names],
    ids=["save_names", "save_all_but_names", "offload_names"],
)
def test_name_policies_value_semantics(make):
    assert make("a", "b") == make("b", "a")
    assert hash(make("a", "b")) == hash(make("b", "a"))
    assert make("a") != make("b")
    with pytest.raises(ValueError, match="expected at least one name"):
        make()
    with pytest.raises(ValueError, match="expected names as strings"):
        make(1)


def test_offload_names_checks_spaces():
    assert er.offload_names("a", dst="pinned_host") != er.offload_names(
        "a", dst="device"
    )
    with pytest.raises(ValueError, match="dst must be a memory-space name"):
        er.offload_names("a", dst=3)
    # JAX would read a misspelt space as "device", and offload nothing.
    with pytest.raises(ValueError, match="dst must be .* Got 'pinned'"):
        er.offload_names("a", dst="pinned")
    with pytest.raises(ValueError, match="src must be .* Got 'host'"):
        er.save_and_offload_names(offload="a", src="host")
    # A layer's values are computed in device memory: offloading them from
    # the host is refused when built, naming `src`, not a bare AssertionError
    # in the backward pass.
    for make in (
        lambda: er.offload_names("a", src="pinned_host"),
        lambda: er.save_and_offload_names(offload="a", src="pinned_host"),
    ):
        with pytest.raises(
            ValueError, match="src must be .*'device'.* Got 'pinned_host'"
        ):
            make()
    with pytest.raises(ValueError, match="src must be"):
        er.parse_checkpoint("offload_names(a, src=pinned_host)")


def test_rebuilt_policy_does_not_recompile():
    def f(x, pol):
        return jax.checkpoint(jnp.sin, policy=pol)(x)

    jitted = jax.jit(jax.grad(lambda x, pol: f(x, pol).sum()), static_argnums=1)
    x = jnp.ones(4)
    for pol in [er.save_names("a"), er.save_names("a"), er.save_all_but_names("a")]:
        jitted(x, pol)
    jitted(x, er.save_all_but_names("a"))
    jitted(x, er.offload_names("a"))
    jitted(x, er.offload_names("a"))
    assert jitted._cache_size() == 3


def _tagged(x, w1, w2):
    # A small layer with two tagged matmuls: `a` is wide (4 × 256), computed from
    # narrow inputs, so recomputing it is cheap in memory.
    a = checkpoint_name(jnp.sin(x) @ w1, "a")
    b = checkpoint_name(jnp.tanh(a) @ w2, "b")
    return jnp.sum(jnp.cos(b))


_ARGS = (jnp.ones((4, 8)), jnp.ones((8, 256)) / 8, jnp.ones((256, 8)) / 256)


def _saved(pol):
    fn = jax.checkpoint(_tagged, policy=er.policy(pol))
    return er.residuals(fn, *_ARGS)


def _bytes(res):
    return sum(r.nbytes for r in res)


def test_named_policies_order_memory():
    everything = _bytes(_saved("everything"))
    dots = _bytes(_saved("dots"))
    nothing = _bytes(_saved("nothing"))
    assert everything > dots > nothing
    # "nothing" saves the arguments alone.
    assert nothing == sum(a.nbytes for a in _ARGS)


def test_save_names_saves_exactly_the_names():
    res = _saved(er.save_names("a"))
    assert [r.name for r in res if r.name is not None] == ["a"]
    arg_bytes = sum(a.nbytes for a in _ARGS)
    assert _bytes(res) == arg_bytes + 4 * 256 * 4
    res = _saved(er.save_names("a", "b"))
    assert sorted(r.name for r in res if r.name) == ["a", "b"]


def _chain_bytes(pol):
    w1, w2 = _ARGS[1], _ARGS[2]

    def layer(x):
        a = checkpoint_name(jnp.sin(x) @ w1, "a")
        return (a * a) @ w2  # the backward pass of `a * a` needs `a`

    fn = lambda x: er.chain([layer], checkpoint=pol)(x).sum()
    return _bytes(er.residuals(fn, _ARGS[0]))


def test_save_all_but_names_excludes_the_names():
    everything = _chain_bytes("everything")
    excluded = _chain_bytes(er.save_all_but_names("a"))
    # `a` (4 × 256 f32) is no longer saved; recomputing it needs only the narrow
    # sin(x) (4 × 8).
    assert excluded == everything - 4 * 256 * 4 + 4 * 8 * 4


def test_jax_save_anything_except_these_names_is_broken():
    # The reason save_all_but_names exists: JAX's ignores its names (jax 0.10.2
    # to 0.12.1). Without remat3 it saves what "everything" saves; under remat3
    # (which saves only what it has a rule for: products, tags) it keeps the
    # value named "a" saved.
    jax_pol = jax.checkpoint_policies.save_anything_except_these_names("a")
    saved = _saved(jax_pol)
    if jax.config.jax_remat3:
        assert "a" in {r.name for r in saved}
    else:
        assert _bytes(saved) == _bytes(_saved("everything"))


def test_save_all_but_names_gradients():
    x = _ARGS[0]
    w1 = _ARGS[1]

    def loss(x, pol):
        layer = lambda x: jnp.tanh(checkpoint_name(jnp.sin(x) @ w1, "a")) @ w1.T
        return er.chain([layer, layer], checkpoint=pol)(x).sum()

    g0 = jax.grad(loss)(x, None)
    g1 = jax.grad(loss)(x, er.save_all_but_names("a"))
    assert jnp.allclose(g0, g1, rtol=1e-5, atol=1e-6)


def test_name_policies_repr_is_deterministic():
    # Sorted, so test ids and logs do not depend on set order (hash seeds).
    assert repr(er.save_names("b", "a")) == "save_names('a', 'b')"
    assert repr(er.save_all_but_names("b", "a")) == "save_all_but_names('a', 'b')"
    assert (
        repr(er.offload_names("b", "a"))
        == "offload_names('a', 'b', src='device', dst='pinned_host')"
    )


def test_residuals_with_prng_keys():
    # Typed keys (dropout keys passed as per-layer inputs) have extended dtypes.
    def f(x, keys):
        layer = lambda c, k: jnp.sin(c) * jax.random.normal(k, ())
        body = lambda c, k: (jax.checkpoint(layer)(c, k), None)
        return jax.lax.scan(body, x, keys)[0]

    res = er.residuals(f, jnp.array(1.0), jax.random.split(jax.random.key(0), 3))
    keys = [r for r in res if jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key)]
    assert len(keys) == 1 and keys[0].shape == (3,) and keys[0].nbytes > 0


@pytest.mark.parametrize("on", [False, True], ids=["", "remat3"])
@pytest.mark.parametrize(
    "pol",
    [
        "offload_dots_no_batch",
        er.offload_names("h"),
        er.save_and_offload_names(offload=("h",)),
    ],
    ids=["offload_dots_no_batch", "offload_names", "save_and_offload_names"],
)
def test_offloading_under_second_order(pol, on):
    """With JAX's remat3 or without. Without, JAX calls the policy on the
    backward pass's reload, and it raises; remat3 never asks it there, so a
    mark on the derivatives of the checkpoint's inputs raises instead."""
    w = jnp.ones((4, 4)) / 4 + jnp.eye(4)

    def f(x, pol):
        layer = lambda c: jnp.sin(checkpoint_name(c @ w, "h")) @ w.T
        return er.chain([layer] * 2, checkpoint=pol)(x).sum()

    x = jnp.linspace(0.0, 1.0, 8).reshape(2, 4)
    with jax_remat3(on):
        if on and jax.__version_info__ < (0, 12):
            # This jax's remat3 would not offload: refused at first order.
            with pytest.raises(NotImplementedError, match="not supported under"):
                jax.grad(f)(x, pol)
            return
        # First order, forward-over-reverse and jax.hessian (the same) work,
        # with the un-checkpointed values.
        assert jnp.allclose(jax.grad(f)(x, pol), jax.grad(f)(x, None), rtol=1e-6)
        hvp = lambda pol: jax.jvp(lambda x: jax.grad(f)(x, pol), (x,), (x,))[1]
        assert jnp.allclose(hvp(pol), hvp(None), rtol=1e-5, atol=1e-6)
        assert jnp.allclose(
            jax.hessian(f)(x, pol), jax.hessian(f)(x, None), rtol=1e-5, atol=1e-6
        )
        # Reverse-over-reverse raises a clear error while tracing.
        with pytest.raises(
            NotImplementedError, match="grad of grad.*not supported"
        ) as e:
            jax.make_jaxpr(jax.grad(lambda x: jax.grad(f)(x, pol).sum()))(x)
    # The message names every offloading policy, the one raising included, and
    # the jax that fails; under remat3, the policy itself.
    for name in ("offload_names", "save_and_offload_names", "offload_dots_no_batch"):
        assert name in str(e.value)
    assert f"jax {jax.__version__} " in str(e.value)
    if on:
        assert repr(er.policy(pol)) in str(e.value)


@pytest.mark.parametrize("on", [False, True], ids=["", "remat3"])
def test_per_name_decisions_that_offload_nothing_support_second_order(on):
    """`save_and_offload_names` with nothing to offload saves what `save_names`
    saves, and is differentiated to any order, with remat3 or without."""
    w = jnp.ones((4, 4)) / 4 + jnp.eye(4)

    def f(x, pol):
        layer = lambda c: jnp.sin(checkpoint_name(c @ w, "h")) @ w.T
        return er.chain([layer] * 2, checkpoint=pol)(x).sum()

    def grad2(pol):
        return jax.grad(lambda x: jax.grad(f)(x, pol).sum())(x)

    x = jnp.linspace(0.0, 1.0, 8).reshape(2, 4)
    pol = er.save_and_offload_names(save=("h",))
    with jax_remat3(on):
        if on and jax.__version_info__ < (0, 12):
            # This jax's remat3 honours only JAX's own policy values.
            with pytest.raises(NotImplementedError, match="not supported under"):
                jax.grad(f)(x, pol)
            return
        assert jnp.allclose(grad2(pol), grad2(None), rtol=1e-5, atol=1e-6)


# --- name policies whose names tag nothing ---------------------------------------

# The name policies, as functions of the names they decide for.
NAME_POLICIES = {
    "save_names": er.save_names,
    "save_all_but_names": er.save_all_but_names,
    "offload_names": er.offload_names,
}
# Where a policy checkpoints a stack of `depth` layers: directly, as the inner
# policy of a schedule, or of a range.
PLACEMENTS = {
    "direct": lambda pol, depth: pol,
    "every": lambda pol, depth: er.every(2, policy=pol),
    "nested": lambda pol, depth: er.nested(2, policy=pol),
    "binomial": lambda pol, depth: er.binomial(2, policy=pol),
}
if hasattr(er, "save_and_offload_names"):  # each of its name sets
    NAME_POLICIES["save_and_offload_names-save"] = lambda *names: (
        er.save_and_offload_names(save=names)
    )
    NAME_POLICIES["save_and_offload_names-offload"] = lambda *names: (
        er.save_and_offload_names(offload=names)
    )
if hasattr(er, "ranges"):
    PLACEMENTS["ranges"] = lambda pol, depth: er.ranges((1, "dots"), (depth - 1, pol))
    PLACEMENTS["ranges-every"] = lambda pol, depth: er.ranges(
        (depth - 1, er.every(2, policy=pol)), (1, None)
    )


def _trace_transformer_grad(checkpoint):
    # 3 layers: every(2) and nested(2) pad their last segment.
    model = zoo.Transformer(
        16, 8, 8, 2, 3, checkpoint=checkpoint, key=jax.random.key(0)
    )
    tokens = jnp.arange(8) % 16
    loss = lambda m, t: jnp.mean(m(t))
    eqx.filter_make_jaxpr(eqx.filter_grad(loss))(model, tokens)
    return model


@pytest.mark.parametrize("place", PLACEMENTS.values(), ids=PLACEMENTS.keys())
@pytest.mark.parametrize("make", NAME_POLICIES.values(), ids=NAME_POLICIES.keys())
def test_name_policy_with_a_name_that_tags_nothing_raises(make, place):
    """A typo (`"qkv_projj"`) would save, offload or recompute other than asked,
    silently: tracing raises, naming the names that tag nothing (only those) and
    listing the model's tags, sorted."""
    model = _trace_transformer_grad(place(make("qkv_proj"), 3))
    tags = sorted(model.activation_names)
    match = (
        rf"^{re.escape(repr(make('qkv_proj', 'qkv_projj')))} expected names that "
        r"tag values .* Got 'qkv_projj', which tags nothing\. The tags there are "
        + re.escape(f"{tags}.")
    )
    with pytest.raises(ValueError, match=match):
        _trace_transformer_grad(place(make("qkv_proj", "qkv_projj"), 3))
    match = r"Got 'mlp_hiden', 'qkv_projj', which tag nothing\."
    with pytest.raises(ValueError, match=match):
        _trace_transformer_grad(place(make("qkv_projj", "mlp_hiden"), 3))


@pytest.mark.parametrize("place", PLACEMENTS.values(), ids=PLACEMENTS.keys())
def test_a_name_that_tags_nothing_raises_on_the_forward_pass(place):
    """The same typo fails at the same point wherever the policy is: tracing
    the forward pass alone, not only its gradient (a schedule applies its
    inner policy, and a range its policy, in the backward pass)."""
    model = zoo.Transformer(16, 8, 8, 2, 3, key=jax.random.key(0))
    tokens = jnp.arange(8) % 16
    forward = eqx.filter_make_jaxpr(lambda m, t: m(t))
    forward(er.set_checkpoint(model, place(er.save_names("qkv_proj"), 3)), tokens)
    bad = er.set_checkpoint(model, place(er.save_names("qkv_projj"), 3))
    with pytest.raises(ValueError, match=r"Got 'qkv_projj', which tags nothing"):
        forward(bad, tokens)


if hasattr(er, "save_and_offload_names"):

    def test_save_and_offload_names_checks_both_name_sets():
        """A name that tags nothing is an error in either set, the other set's
        names all tagging values."""
        for save, offload, bad in [
            (("qkv_proj",), ("mlp_hiden",), "mlp_hiden"),
            (("qkv_projj",), ("mlp_hidden",), "qkv_projj"),
        ]:
            pol = er.save_and_offload_names(save=save, offload=offload)
            with pytest.raises(ValueError, match=rf"Got '{bad}', which tags nothing"):
                _trace_transformer_grad(er.every(2, policy=pol))
        pol = er.save_and_offload_names(save="qkv_proj", offload="mlp_hidden")
        _trace_transformer_grad(er.every(2, policy=pol))


def _tagged_in(name):
    """A layer whose only tag is `name`, inside an inner scan and a `cond`."""

    def layer(x):
        def body(c, _):
            c = jax.lax.cond(c[0] > 0, jnp.sin, jnp.cos, c)
            return checkpoint_name(c * 1.5, name), None

        return jnp.tanh(jax.lax.scan(body, x, length=2)[0])

    return layer


# Tag "a" in the first and last layers only, "b" in the third only.
_CHAIN_OF_TAGGED = [_tagged_in("a"), jnp.sin, _tagged_in("b"), _tagged_in("a")]
_chain_of_tagged_grad = jax.jit(
    jax.grad(lambda x, ck: jnp.sum(er.chain(_CHAIN_OF_TAGGED, checkpoint=ck)(x) ** 2)),
    static_argnums=1,
)


@pytest.mark.parametrize("place", PLACEMENTS.values(), ids=PLACEMENTS.keys())
@pytest.mark.parametrize("make", NAME_POLICIES.values(), ids=NAME_POLICIES.keys())
def test_name_policy_with_names_tagged_in_some_layers_only(make, place):
    """A name that tags values in some layers only (a chain of different
    functions; the tags inside control flow) is fine. Gradients are those without
    checkpointing (compiled for the two ways a name policy is applied: saving or
    offloading by name, and `save_all_but_names`' own)."""
    grad = _chain_of_tagged_grad
    x = jnp.array([0.3, -0.2, 0.5])
    for names in [("a",), ("b",), ("a", "b")]:
        jax.make_jaxpr(grad, static_argnums=1)(x, place(make(*names), 4))
    if make in (er.save_names, er.save_all_but_names):
        got = grad(x, place(make("a", "b"), 4))
        assert eqx.tree_equal(got, grad(x, None), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"Got 'c', which tags.* are \['a', 'b'\]"):
        jax.make_jaxpr(grad, static_argnums=1)(x, place(make("a", "c"), 4))


def test_name_policy_on_a_function_without_tags_raises():
    loss = lambda x, ck: er.chain([jnp.sin] * 3, checkpoint=ck)(x)
    with pytest.raises(ValueError, match="That function has no checkpoint_name tags"):
        jax.grad(loss)(1.0, er.save_names("a"))
    # Only eqx_remat's name policies are checked: JAX's own are left as they are.
    jax_policy = jax.checkpoint_policies.save_only_these_names("a")
    assert jnp.allclose(jax.grad(loss)(1.0, jax_policy), jax.grad(loss)(1.0, None))


def test_the_tag_check_does_not_depend_on_the_module_of_the_policy():
    """A name policy's class decides whether its names are checked, wherever it
    is defined: a subclass defined here (another module) is checked too."""

    class MyNames(er.save_names):
        pass

    loss = lambda x, ck: er.chain([jnp.sin] * 3, checkpoint=ck)(x)
    with pytest.raises(ValueError, match="That function has no checkpoint_name tags"):
        jax.grad(loss)(1.0, MyNames("a"))


# --- the shared validators -----------------------------------------------------


def test_check_int_takes_any_integer_and_returns_an_int():
    import numpy as np

    for value in [3, np.int64(3), np.int32(3), np.uint8(3), jnp.int32(3)]:
        got = er.internal.check_int("every", "k", value, 1)
        assert got == 3 and type(got) is int
    assert er.internal.check_int("plan", "budget_bytes", 0, 0) == 0


@pytest.mark.parametrize(
    "value, match",
    [
        (True, r"every: k must be an int >= 1\. Got True of type bool"),
        (2.0, r"every: k must be an int >= 1\. Got 2\.0 of type float"),
        ("2", r"every: k must be an int >= 1\. Got '2' of type str"),
        (0, r"every: k must be an int >= 1\. Got 0\."),
        (jnp.ones(2, dtype=jnp.int32), r"every: k must be an int >= 1"),
    ],
    ids=["bool", "float", "str", "too-small", "array"],
)
def test_check_int_rejects(value, match):
    with pytest.raises(ValueError, match=match):
        er.internal.check_int("every", "k", value, 1)


def test_check_checkpoint():
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    for spec in [None, "dots", er.every(2), er.save_names("a"), policy]:
        assert er.internal.check_checkpoint(spec) is spec
    with pytest.raises(
        ValueError, match=r"^MyModel: checkpoint expected None, .*Unknown policy 'dot'"
    ):
        er.internal.check_checkpoint("dot", name="MyModel: checkpoint")
    with pytest.raises(ValueError, match=r"^checkpoint expected None"):
        er.internal.check_checkpoint(3)


@pytest.mark.parametrize("package", ["eqx_remat", "eqx_remat.internal", "zoo"])
def test_namespaces_export_exactly_all(package):
    import importlib
    import types

    module = importlib.import_module(package)
    public = {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert set(module.__all__) == public
    leaked = [
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and isinstance(v, types.ModuleType)
    ]
    # pytest's jaxtyping import hook (pyproject's addopts) injects `jaxtyping`
    # into instrumented packages; a plain import does not. `eqx_remat.internal`
    # is a namespace of its own, as `equinox.internal`.
    allowed = {"jaxtyping", "internal"} if package == "eqx_remat" else {"jaxtyping"}
    assert [n for n in leaked if n not in allowed] == []


# --- save_and_offload_names: per-name decisions in one value -------------------


def test_save_and_offload_names_value_semantics():
    pol = er.save_and_offload_names(save=("a", "b"), offload=("c",))
    same = er.save_and_offload_names(offload="c", save=["b", "a"])
    assert pol == same and hash(pol) == hash(same)
    assert pol.save == {"a", "b"} and pol.offload == {"c"}
    assert pol.names == {"a", "b", "c"}
    assert pol != er.save_and_offload_names(save=("a",), offload=("b", "c"))
    assert pol != er.save_and_offload_names(save=("a", "b"), offload="c", dst="device")
    assert repr(same) == (
        "save_and_offload_names(save=('a', 'b'), offload=('c',), "
        "src='device', dst='pinned_host')"
    )
    # One JAX policy per value: equal values do not recompile.
    assert pol._jax_policy is same._jax_policy
    f = jax.jit(
        jax.grad(lambda x, p: jax.checkpoint(jnp.sin, policy=p)(x).sum()),
        static_argnums=1,
    )
    for p in [pol, same, er.save_and_offload_names(save=("b", "a"), offload="c")]:
        f(jnp.ones(4), p)
    assert f._cache_size() == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "expected at least one name. Got none"),
        ({"save": (), "offload": ()}, "expected at least one name"),
        ({"save": ("a", "b"), "offload": ("b",)}, "not both. Got 'b' in both"),
        ({"save": ("a", 1)}, "expected names as strings.*Got 1 of type int"),
        ({"offload": ("",)}, "expected non-empty names"),
        ({"save": 3}, "save expected a tuple of names.*Got 3"),
        ({"offload": "a", "src": None}, "src must be a memory-space name"),
    ],
    ids=["none", "empty", "both", "not-a-string", "empty-name", "not-a-tuple", "src"],
)
def test_save_and_offload_names_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        er.save_and_offload_names(**kwargs)


def _two_tags(c, w):
    a = checkpoint_name(jnp.tanh(c @ w), "a")
    b = checkpoint_name(jnp.tanh(a @ w), "b")
    return jnp.tanh(b @ w)


def _two_tags_loss(w, x, pol):
    f = _two_tags if pol is None else jax.checkpoint(_two_tags, policy=er.policy(pol))
    return jax.lax.scan(lambda c, w: (f(c, w), None), x, w)[0].sum()


@pytest.mark.heavy
def test_save_and_offload_names_saves_offloads_and_recomputes_by_name():
    w = jnp.ones((4, 64, 64)) / 64  # every(2) divides the depth: no padding
    x = jnp.ones((16, 64))
    pol = er.save_and_offload_names(save=("a",), offload=("b",))
    res = er.residuals(lambda w, x: _two_tags_loss(w, x, pol), w, x)
    # `a` is saved (by name); `b` goes through a transfer to the host memory
    # space (a device_put; on the CPU it stays where it is); the rest is
    # recomputed from the layer inputs.
    stacked = {(r.name, r.source.split(" from ")[0]) for r in res if r.layers == 4}
    assert ("a", "named 'a'") in stacked
    assert (None, "output of device_put") in stacked
    assert len([r for r in res if r.layers == 4]) == 3  # a, b's transfer, the carry
    saving = er.residuals(
        lambda w, x: _two_tags_loss(w, x, er.save_names("a", "b")), w, x
    )
    assert sum(r.nbytes for r in res) == sum(r.nbytes for r in saving)
    assert not any("device_put" in r.source for r in saving)
    # Gradients are the un-checkpointed ones, here and as the inner policy of
    # a schedule and of a range.
    g = jax.grad(_two_tags_loss, argnums=(0, 1))
    ref = g(w, x, None)
    assert jnp.allclose(g(w, x, pol)[0], ref[0], rtol=1e-6)

    def stacked_loss(w, x, ck):
        return er.scan_layers(_Tagged(w), x, checkpoint=ck).sum()

    gs = jax.grad(stacked_loss, argnums=(0, 1))
    for ck in [
        pol,
        er.every(2, pol),
        er.binomial(2, pol),
        er.ranges((1, pol), (3, er.every(1, pol))),
    ]:
        got = gs(w, x, ck)
        assert all(
            jnp.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(got, ref)
        ), ck


class _Tagged(eqx.Module):
    w: jax.Array

    def __call__(self, c):
        return _two_tags(c, self.w)


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="needs libtpu: pip install 'eqx-remat[tpu]'",
)
@pytest.mark.heavy
def test_save_and_offload_names_moves_only_the_offloaded_names_to_host():
    # Compiled for TPU v5e, where host memory is real (the CPU has one memory
    # and reports no host bytes). Every intermediate in HBM (no VMEM), so that
    # small programs can be compared.
    no_vmem = {"xla_vf_vmem_memory_space_assignment": False}
    args = (
        jax.ShapeDtypeStruct((4, 256, 256), jnp.float32),
        jax.ShapeDtypeStruct((1024, 256), jnp.float32),
    )

    def report(pol):
        fn = jax.grad(lambda w, x: _two_tags_loss(w, x, pol))
        with pytest.warns(er.ReplicatedArgumentsWarning):  # replicated on purpose
            return er.memory_report(fn, *args, target="v5e", compiler_options=no_vmem)

    both = report(er.save_names("a", "b"))
    mixed = report(er.save_and_offload_names(save=("a",), offload=("b",)))
    offload_b = report(er.offload_names("b"))
    layer_value = 1024 * 256 * 4
    assert both.host_temp_bytes == 0
    # `b` of each of the 4 layers is on the host, as with offload_names("b").
    assert mixed.host_temp_bytes == offload_b.host_temp_bytes >= 4 * layer_value
    # The device keeps less than when it saves both, more than when it saves
    # only what offload_names("b") keeps (it also keeps `a`).
    assert offload_b.temp_bytes < mixed.temp_bytes < both.temp_bytes


# --- under JAX's remat3 ----------------------------------------------------------


@pytest.fixture
def remat3():
    """`jax_remat3=True` for one test (jax 0.10.2 has it off; later jax turns it
    on): `jax.checkpoint` honours only JAX's own name policies at a tag."""
    if not hasattr(jax.config, "jax_remat3"):
        pytest.skip("this jax has no jax_remat3 flag")
    with jax_remat3(True):
        yield


class _TaggedLayer(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return jnp.tanh(checkpoint_name(x * self.w, "h"))


def test_under_remat3_policies_are_jax_values_or_fail_clearly(remat3):
    """Under remat3 the combinators give JAX its own value for `save_names`
    (`save_only_these_names`), one value per set of names, so that a rebuilt
    policy compiles nothing again (jax 0.12 makes JAX's a new function at each
    call); every name policy gives the gradients it gives without remat3, with
    the same tag check. What this jax's remat3 cannot honour (jax 0.10.2: an
    offloading policy) raises a `NotImplementedError` naming the policy and the
    jax version, instead of silently recomputing every tag.
    (tests/test_remat3.py compares what each policy saves and counts.)"""
    from eqx_remat._policies._apply import for_remat3

    jax_pol = for_remat3(er.save_names("b", "a"))
    assert jax_pol is for_remat3(er.save_names("a", "b"))
    assert jax_pol is not for_remat3(er.save_names("a"))
    f = jax.jit(
        jax.grad(lambda x, p: jax.checkpoint(jnp.sin, policy=p)(x).sum()),
        static_argnums=1,
    )
    for names in [("a", "b"), ("b", "a"), ("a", "b")]:
        f(jnp.ones(4), for_remat3(er.save_names(*names)))
    assert f._cache_size() == 1
    layers = _TaggedLayer(jnp.linspace(0.5, 1.5, 4))
    grad = jax.grad(lambda x, ck: er.scan_layers(layers, x, checkpoint=ck))
    ref = grad(1.0, None)
    for ck in [
        "dots",
        er.save_names("h"),
        er.every(2, policy=er.save_names("h")),
        er.save_all_but_names("h"),
    ]:
        assert jnp.allclose(grad(1.0, ck), ref), ck
    with pytest.raises(ValueError, match="Got 'hh', which tags nothing"):
        grad(1.0, er.save_names("hh"))
    with pytest.raises(ValueError, match="Got 'hh', which tags nothing"):
        grad(1.0, er.save_all_but_names("hh"))
    offload = er.offload_names("h")
    if jax.__version_info__ >= (0, 12):  # its remat3 asks any policy
        assert jnp.allclose(grad(1.0, offload), ref)
    else:  # jax 0.10.2's remat3 honours only JAX's own values, by their type
        message = f"{re.escape(repr(offload))} is not supported under JAX's remat3"
        with pytest.raises(NotImplementedError, match=message + r".* jax 0\.10"):
            grad(1.0, offload)

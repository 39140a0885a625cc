"""zoo.Transformer: gradients under every policy, name policy and schedule;
dropout; bf16 compute; compiled memory; bad input."""

import functools
import typing

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import raises_bad_input, temp_bytes
from hypothesis import given, settings
from zoo_helpers import build, quick_jit

import eqx_remat as er
import zoo
from zoo._attention import Attention
from zoo._layers import Norm
from zoo._transformer import Mlp, Position


NAMES = zoo.Transformer.ACTIVATION_NAMES

# Every policy name, name policies on the transformer's own tags, and every
# schedule (with inner policies where a schedule takes one).
CHECKPOINTS = [
    *sorted(er.POLICIES),
    er.save_names(*NAMES),
    er.save_names("qkv_proj", "attention_context", "mlp_hidden"),
    er.save_all_but_names("mlp_hidden", "qkv_proj"),
    er.offload_names("mlp_hidden"),
    er.every(1),
    er.every(2),
    er.every(2, policy=er.save_names("attention_context", "mlp_hidden")),
    er.every(5, policy="nothing"),
    er.nested(2),
    er.nested(3),
    er.nested(2, policy="dots"),
    er.recursive(),
]
if hasattr(er, "binomial"):
    CHECKPOINTS += [er.binomial(2), er.binomial(3, policy="dots_no_batch")]

# The checkpoints of the default run; the rest run with `-m slow` (a transformer's
# gradient takes seconds to compile on two cores). The property test below draws
# from all of them in every run.
FAST = {"dots", "nothing", er.save_names(*NAMES), er.every(2), er.recursive()}


def ck_id(ck) -> str:
    return getattr(ck, "__name__", None) or str(ck)


def ck_params(cks, *, heavy=()):
    """`cks` as parameters: those not in `FAST` marked slow, those in `heavy`
    marked heavy."""
    return [
        pytest.param(
            c,
            marks=[
                *([] if c in FAST else [pytest.mark.slow]),
                *([pytest.mark.heavy] if c in heavy else []),
            ],
            id=ck_id(c),
        )
        for c in cks
    ]


def loss(model, tokens, keys=None):
    """Mean next-token cross-entropy over a batch (vmapped, one key per example)."""
    logits = jax.vmap(model)(tokens, key=keys)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


# Shared by all tests: each (shapes, checkpoint) pair compiles once.
_grads = quick_jit(eqx.filter_grad(loss))
_forward = quick_jit(lambda m, t, k=None: jax.vmap(m)(t, key=k))


def grads(model, tokens, keys=None):
    # Gradients are models; give them one checkpoint so that they compare.
    return er.set_checkpoint(_grads(model, tokens, keys), None)


def max_rel_error(got, ref) -> float:
    """max |got - ref| over each leaf, relative to that leaf's largest |ref|."""
    errors = []
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errors.append(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    return max(errors)


def assert_same_gradients(model, tokens, ck, keys=None):
    ref = grads(er.set_checkpoint(model, None), tokens, keys)
    got = grads(er.set_checkpoint(model, ck), tokens, keys)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref))
    assert eqx.tree_equal(got, ref, rtol=1e-5, atol=1e-5 * scale), ck_id(ck)


def tiny(num_layers=3, **kwargs):
    # vocab 16, max_len 8, d_model 8, 2 heads.
    return zoo.Transformer(16, 8, 8, 2, num_layers, key=jr.key(0), **kwargs)


TOKENS = jr.randint(jr.key(1), (2, 7), 0, 16)


# --- gradients equal the un-checkpointed model's ------------------------------


@pytest.mark.parametrize("ck", ck_params(CHECKPOINTS, heavy=["dots"]))
def test_gradients(ck):
    assert_same_gradients(tiny(), TOKENS, ck)


@pytest.mark.heavy
@settings(max_examples=min(settings().max_examples, 4))
@given(
    head_dim=st.integers(1, 4),
    num_heads=st.integers(1, 3),
    num_layers=st.integers(1, 12),
    seq=st.integers(1, 6),
    batch=st.integers(1, 3),
    ck=st.sampled_from(CHECKPOINTS),
    seed=st.integers(0, 2**16),
)
def test_gradients_property(head_dim, num_heads, num_layers, seq, batch, ck, seed):
    d_model = head_dim * num_heads
    # Initialised under one jit: new shapes compile once rather than op by op.
    model = build(
        zoo.Transformer, 11, 6, d_model, num_heads, num_layers, d_ff=3, key=jr.key(seed)
    )
    tokens = jr.randint(jr.key(seed + 1), (batch, seq), 0, 11)
    assert_same_gradients(model, tokens, ck)


@pytest.mark.parametrize("name", NAMES)
def test_save_names_saves_the_tagged_value(name):
    """`save_names(name)` saves, across layers, the layer inputs (as "nothing" does)
    plus the tagged value when the backward pass needs it: one more stacked array
    of shape (layers, batch, seq, width)."""
    layers, batch, seq = 3, 2, 7
    model = tiny(layers)

    def stacked(ck):
        res = er.residuals(loss, er.set_checkpoint(model, ck), TOKENS)
        return sorted(r.shape for r in res if r.shape[:3] == (layers, batch, seq))

    assert stacked("nothing") == [(layers, batch, seq, 8)]  # the layer inputs
    width = {"qkv_proj": 24, "mlp_hidden": 32}.get(name, 8)  # d_model 8, d_ff 32
    if name in ("layer_input", "mlp_out"):
        # The layer input is saved anyway, and the MLP's output only feeds the
        # block's last residual add: the backward pass needs neither again.
        assert stacked(er.save_names(name)) == [(layers, batch, seq, 8)]
    else:
        expected = sorted([(layers, batch, seq, 8), (layers, batch, seq, width)])
        assert stacked(er.save_names(name)) == expected


def test_set_checkpoint_switches_schedule():
    model = tiny()
    ref = grads(model, TOKENS)
    for ck in ("nothing", er.recursive()):
        switched = er.set_checkpoint(model, ck)
        assert switched.checkpoint == ck
        assert switched.blocks is not model.blocks
        for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(switched)):
            assert a is b
        assert eqx.tree_equal(grads(switched, TOKENS), ref, rtol=1e-5, atol=1e-7)


# --- the model -------------------------------------------------------------------


def test_shapes_and_causality():
    model = tiny(3)
    tokens = jnp.array([[1, 2, 3, 4, 5, 6, 7]])
    changed = tokens.at[0, 4].set(9)
    logits, logits_changed = _forward(model, jnp.concatenate([tokens, changed]))
    assert logits.shape == (7, 16) and logits.dtype == jnp.float32
    # Position i sees tokens[: i + 1] only.
    assert jnp.array_equal(logits[:4], logits_changed[:4])
    assert not jnp.allclose(logits[4:], logits_changed[4:])


def test_architecture():
    model = tiny(3)
    assert NAMES == (
        "layer_input",
        "qkv_proj",
        "attention_context",
        "out_proj",
        "mlp_hidden",
        "mlp_out",
    )
    assert model.d_ff == 32  # 4 * d_model by default
    # Weights are (in, out), stacked over layers.
    assert model.blocks.qkv.weight.shape == (3, 8, 24)
    assert model.blocks.mlp_in.weight.shape == (3, 8, 32)
    assert model.position_embedding.weight.shape == (8, 8)
    # An untied output head, without bias.
    assert model.head.weight.shape == (8, 16) and model.head.bias is None
    assert model.head.weight is not model.token_embedding.weight
    assert tiny(d_ff=5).blocks.mlp_in.weight.shape == (3, 8, 5)


# --- dropout ---------------------------------------------------------------------


def dropout_model():
    return tiny(3, dropout=0.3)


def batch_keys(seed=2, batch=2):
    return jr.split(jr.key(seed), batch)


@pytest.mark.parametrize(
    "ck",
    [pytest.param("nothing", marks=pytest.mark.heavy), er.every(2), er.recursive()],
    ids=ck_id,
)
def test_dropout_gradients(ck):
    """Per-layer keys are scan inputs: a recomputed layer draws the same mask."""
    assert_same_gradients(dropout_model(), TOKENS, ck, batch_keys())


def test_dropout_is_random_and_inference_mode_turns_it_off():
    model = dropout_model()
    a = _forward(model, TOKENS, batch_keys(2))
    b = _forward(model, TOKENS, batch_keys(3))
    assert not jnp.allclose(a, b)
    # Same key, any schedule: same output.
    assert jnp.array_equal(
        _forward(er.set_checkpoint(model, er.recursive()), TOKENS, batch_keys(2)), a
    )
    # inference_mode: no dropout, no key needed, the model without dropout.
    off = eqx.nn.inference_mode(model)
    no_dropout = tiny(3)
    assert jnp.array_equal(_forward(off, TOKENS), _forward(no_dropout, TOKENS))


def test_dropout_masks_are_not_saved():
    """Under "nothing", nothing mask-shaped (bool) is saved across layers: masks are
    recomputed from the per-layer keys (jax#17982)."""
    model = dropout_model()
    # Raw uint32 keys: eqx_remat.residuals can't describe typed-key residuals yet.
    keys = jr.split(jr.PRNGKey(2), 2)

    def saved(ck):
        return er.residuals(loss, er.set_checkpoint(model, ck), TOKENS, keys)

    def masks(ck):
        return [r.shape for r in saved(ck) if r.dtype == np.bool_ and r.shape]

    # Without checkpointing the masks are saved, stacked over the 3 layers ...
    assert (3, 2, 7, 8) in masks(None)
    # ... under "nothing", only the embedding dropout's (outside the scan) is.
    assert masks("nothing") == [(2, 7, 8)]


def test_dropout_needs_a_key():
    with pytest.raises(ValueError, match=r"dropout=0\.3: pass key=\.\.\."):
        dropout_model()(TOKENS[0])


# --- bf16 compute ------------------------------------------------------------------


@pytest.mark.parametrize(
    "ck",
    [
        pytest.param("nothing", marks=pytest.mark.heavy),
        pytest.param(er.every(2), marks=pytest.mark.slow),
    ],
    ids=ck_id,
)
def test_bf16_gradients(ck):
    """bf16 activations, float32 parameters: checkpointing re-runs the same bf16
    computation, so the gradients agree to bf16 rounding.

    On CPU they are bit-identical. The tolerance leaves room for a compiler that
    fuses (and so rounds) the recomputed forward differently from the original:
    one rounding of a bf16 value moves it by at most 2^-8 relative; we allow two
    such roundings, 2^-7, relative to each gradient leaf's largest entry. (The
    bf16-vs-float32 difference of these gradients is ~1e-2, so this tolerance
    would still catch e.g. a recomputation in a different dtype.)
    """
    model = tiny(3, dtype=jnp.bfloat16)
    ref = grads(model, TOKENS)
    got = grads(er.set_checkpoint(model, ck), TOKENS)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(got))
    assert max_rel_error(got, ref) <= 2**-7


def test_bf16_activations():
    model = tiny(3, dtype=jnp.bfloat16)
    assert model.dtype == jnp.bfloat16
    params = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    assert all(p.dtype == jnp.float32 for p in params)
    assert eqx.filter_eval_shape(jax.vmap(model), TOKENS).dtype == jnp.float32
    # The activations saved for the backward pass are bf16.
    assert any(r.dtype == jnp.bfloat16 for r in er.residuals(loss, model, TOKENS))
    # bf16 gradients are close to, but not, the float32 ones.
    assert 0 < max_rel_error(grads(model, TOKENS), grads(tiny(3), TOKENS)) < 0.1


@pytest.mark.heavy
def test_dtype_none_follows_the_default_float_type():
    """`dtype=None` is JAX's default float type, as in Equinox: float32, and
    float64 under x64, where everything (parameters, norms, softmax, logits)
    is float64, and eager and jitted gradients agree to float64 precision."""
    assert tiny(1).dtype == jnp.float32
    with jax.enable_x64(True):
        model = tiny(2, position="rope")
        tokens = TOKENS.astype(jnp.int64)
        assert model.dtype == jnp.float64
        params = jax.tree.leaves(eqx.filter(model, eqx.is_array))
        assert all(p.dtype == jnp.float64 for p in params)
        assert eqx.filter_eval_shape(jax.vmap(model), tokens).dtype == jnp.float64
        assert all(r.dtype != jnp.float32 for r in er.residuals(loss, model, tokens))
        eager = eqx.filter_grad(loss)(model, tokens)
        jitted = eqx.filter_jit(eqx.filter_grad(loss))(model, tokens)
        assert max_rel_error(eager, jitted) < 1e-12


# --- compiled memory -------------------------------------------------------------


@functools.cache
def lm_temp_bytes(ck, dropout: float) -> int:
    """Compiled temp bytes of the loss gradient: d_model 256, 8 layers, 4 heads,
    seq 256, batch 8, vocab 256, float32. Compiled only, never run."""
    model = zoo.Transformer(
        256, 256, 256, 4, 8, dropout=dropout, checkpoint=ck, key=jr.key(0)
    )
    params, static = eqx.partition(model, eqx.is_array)
    tokens = jax.ShapeDtypeStruct((8, 256), jnp.int32)
    keys = jax.ShapeDtypeStruct((8,), jr.key(0).dtype) if dropout else None

    def grad(params, tokens, keys):
        return jax.grad(lambda p: loss(eqx.combine(p, static), tokens, keys))(params)

    return temp_bytes(grad, params, tokens, keys)


# "dots" against no checkpoint: 285.9 / 501.6 MiB (0.57) with jax 0.10.2. jax
# 0.12.1's CPU compiler needs 14% less for no checkpoint (429.0 MiB) and the
# same for "dots" (285.8 MiB): 0.67. ("nothing": 0.20 with both.)
_DOTS_RATIO = 0.6 if jax.__version_info__ < (0, 12) else 0.7


@pytest.mark.heavy
@pytest.mark.parametrize("ck, ratio", [("dots", _DOTS_RATIO), ("nothing", 0.3)])
def test_memory(ck, ratio):
    assert lm_temp_bytes(ck, 0.0) <= ratio * lm_temp_bytes(None, 0.0)


@pytest.mark.heavy
def test_memory_dropout():
    """Dropout masks are recomputed, not saved: "nothing" with dropout costs at most
    15% more temp memory than without."""
    assert lm_temp_bytes("nothing", 0.1) <= 1.15 * lm_temp_bytes("nothing", 0.0)


# --- bad input ---------------------------------------------------------------------


def test_bad_tokens():
    model = tiny()
    with pytest.raises(
        ValueError, match=r"length 1 to max_len=8\. Got tokens of shape \(9,\)"
    ):
        model(jnp.zeros(9, jnp.int32))
    with pytest.raises(ValueError, match=r"Got tokens of shape \(0,\)"):
        model(jnp.zeros(0, jnp.int32))
    # Wrong dtype or rank: jaxtyping + beartype name the argument, at trace time.
    with pytest.raises(TypeError, match="parameter 'tokens'"):
        eqx.filter_eval_shape(model, jnp.zeros(5, jnp.float32))
    with pytest.raises(TypeError, match="parameter 'tokens'"):
        eqx.filter_eval_shape(model, jnp.zeros((2, 5), jnp.int32))


def test_dropout_takes_any_real_scalar():
    # NumPy's and JAX's scalars too (np.float32(0.1) was refused as not in [0, 1)).
    for rate in (np.float32(0.1), jnp.float32(0.1), 0.1):
        model = zoo.Transformer(16, 8, 8, 2, 1, dropout=rate, key=jax.random.key(0))
        assert type(model.dropout) is float and model.dropout == pytest.approx(0.1)
    for bad in ("0.1", np.array([0.1])):
        with raises_bad_input(r"dropout must be in \[0, 1\)", param="dropout"):
            zoo.Transformer(16, 8, 8, 2, 1, dropout=bad, key=jax.random.key(0))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"d_model": 10, "num_heads": 3},
            r"d_model must be divisible by num_heads\. Got d_model=10, num_heads=3",
        ),
        ({"num_layers": 0}, r"num_layers must be an int >= 1\. Got 0"),
        ({"num_heads": 0}, r"num_heads must be an int >= 1\. Got 0"),
        ({"vocab_size": 0}, r"vocab_size must be an int >= 1\. Got 0"),
        ({"d_ff": 0}, r"d_ff must be an int >= 1\. Got 0"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)\. Got 1\.0"),
        ({"dtype": jnp.int32}, r"dtype must be a floating dtype"),
        ({"checkpoint": "dotz"}, r"Unknown policy 'dotz'.*'dots'"),
    ],
    ids=["heads", "layers0", "heads0", "vocab0", "dff0", "dropout1", "dtype", "ckpt"],
)
def test_bad_config(kwargs, match):
    args = {
        "vocab_size": 16,
        "max_len": 8,
        "d_model": 8,
        "num_heads": 2,
        "num_layers": 2,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        zoo.Transformer(**args, key=jr.key(0))


# --- options: attention, norm, position, mlp, grouped-query, tied embeddings ------


def flash_interpret():
    """Pallas' TPU flash kernel on the CPU: the classic (effect-free) interpreter,
    which works under `jax.checkpoint` and the schedules."""
    import jax.experimental.pallas.tpu as pltpu

    return pltpu.force_tpu_interpret_mode(True)


@st.composite
def options(draw):
    """A sampled combination of every option (rather than their full product)."""
    head_dim = draw(st.sampled_from([2, 4]))
    num_heads = draw(st.sampled_from([1, 2, 4]))
    return {
        "d_model": head_dim * num_heads,
        "num_heads": num_heads,
        "num_kv_heads": draw(
            st.sampled_from([d for d in (1, 2, 4) if num_heads % d == 0])
        ),
        # Every choice of each option, as the model declares them.
        "attention": draw(st.sampled_from(typing.get_args(Attention))),
        "norm": draw(st.sampled_from(typing.get_args(Norm))),
        "position": draw(st.sampled_from(typing.get_args(Position))),
        "mlp": draw(st.sampled_from(typing.get_args(Mlp))),
        "tie_embeddings": draw(st.booleans()),
        "use_bias": draw(st.booleans()),
    }


@pytest.mark.heavy
@settings(max_examples=min(settings().max_examples, 4))
@given(
    opts=options(),
    num_layers=st.integers(1, 5),
    seq=st.integers(1, 6),
    batch=st.integers(1, 2),
    ck=st.sampled_from(CHECKPOINTS),
    seed=st.integers(0, 2**16),
)
def test_gradients_options_property(opts, num_layers, seq, batch, ck, seed):
    """Every option, sampled in combination, under every policy and schedule: the
    checkpointed gradients equal the un-checkpointed ones."""
    opts = dict(opts)
    d_model, num_heads = opts.pop("d_model"), opts.pop("num_heads")
    model = build(
        zoo.Transformer, 11, 6, d_model, num_heads, num_layers, d_ff=3,
        key=jr.key(seed), **opts,
    )  # fmt: skip
    tokens = jr.randint(jr.key(seed + 1), (batch, seq), 0, 11)
    if opts["attention"] == "flash":
        with flash_interpret():
            assert_same_gradients(model, tokens, ck)
    else:
        assert_same_gradients(model, tokens, ck)


OPTIONS = {
    "rms": {"norm": "rms"},
    "rope": {"position": "rope"},
    "swiglu": {"mlp": "swiglu"},
    "mqa": {"num_kv_heads": 1},
    "tied": {"tie_embeddings": True},
    "dot_product": {"attention": "dot_product", "num_kv_heads": 1},
    "flash": {"attention": "flash", "num_kv_heads": 1, "position": "rope"},
}
# The slowest combinations (each 4 s or more on two cores) run with `-m heavy`.
_HEAVY_OPTIONS = {
    "nothing": {"rms", "rope", "mqa", "dot_product", "flash"},
    "every(k=2, policy=None)": {"mqa", "dot_product", "flash"},
}


@pytest.mark.parametrize(
    "ck, kwargs",
    [
        pytest.param(
            ck,
            kwargs,
            id=f"{ck_id(ck)}-{name}",
            marks=[pytest.mark.heavy] if name in _HEAVY_OPTIONS[ck_id(ck)] else [],
        )
        for name, kwargs in OPTIONS.items()
        for ck in ["nothing", er.every(2)]
    ],
)
def test_option_gradients(ck, kwargs):
    if kwargs.get("attention") == "flash":
        with flash_interpret():
            assert_same_gradients(tiny(**kwargs), TOKENS, ck)
    else:
        assert_same_gradients(tiny(**kwargs), TOKENS, ck)


@pytest.mark.heavy
def test_attention_implementations_agree():
    """`"dot_product"` and `"flash"` compute `"xla"`'s attention (grouped-query,
    rotary, the Llama block), forward and gradients, to float32 rounding."""
    kwargs = dict(num_kv_heads=1, key=jr.key(0))
    ref = zoo.Transformer.llama(16, 8, 8, 2, 2, attention="xla", **kwargs)
    ref_out, ref_grads = _forward(ref, TOKENS), grads(ref, TOKENS)
    for attention in ("dot_product", "flash"):
        model = zoo.Transformer.llama(16, 8, 8, 2, 2, attention=attention, **kwargs)
        model = er.set_checkpoint(model, "dots")
        with flash_interpret():
            out, got = _forward(model, TOKENS), grads(model, TOKENS)
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
        assert max_rel_error(got, ref_grads) < 1e-5, attention


@pytest.mark.heavy
def test_gqa_equals_repeated_heads():
    """Grouped-query attention is multi-head attention with each key/value head
    shared by its group of query heads."""
    from zoo._attention import _xla_attention

    q = jr.normal(jr.key(0), (5, 4, 3))
    k, v = jr.normal(jr.key(1), (5, 2, 3)), jr.normal(jr.key(2), (5, 2, 3))
    got = _xla_attention(q, k, v)
    want = _xla_attention(q, jnp.repeat(k, 2, axis=1), jnp.repeat(v, 2, axis=1))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_head_dim_sets_the_attention_width():
    """`head_dim` other than `d_model // num_heads`: attention `num_heads *
    head_dim` wide (MaxText's and Gemma's models), the projections sized for
    it, gradients equal under checkpointing, and an odd one refused by rope."""
    model = tiny(2, head_dim=6, num_kv_heads=1, position="rope")
    assert model.head_dim == 6 and tiny(2).head_dim == 4
    # q: 2 heads, k and v: 1 each, of 6; stacked over 2 layers.
    assert model.blocks.qkv.weight.shape == (2, 8, 24)
    assert model.blocks.out.weight.shape == (2, 12, 8)
    assert _forward(model, TOKENS).shape == (2, 7, 16)
    assert_same_gradients(model, TOKENS, "nothing")
    with pytest.raises(ValueError, match=r"even head dimension\. Got head_dim=3"):
        tiny(2, head_dim=3, position="rope")
    with pytest.raises(ValueError, match=r"head_dim must be an int >= 1"):
        tiny(2, head_dim=0)
    zoo.Transformer(16, 8, 10, 3, 1, head_dim=4, key=jr.key(0))  # 3 ∤ 10: fine


def test_flash_needs_a_tpu():
    model = zoo.Transformer(16, 8, 8, 2, 2, attention="flash", key=jr.key(0))
    with pytest.raises(ValueError, match=r"needs a TPU.*'dot_product'.*'xla'"):
        eqx.filter_eval_shape(model, TOKENS[0])


def test_dense():
    """`zoo.Dense`: an `(in, out)` weight, `x @ weight + bias` in `x`'s dtype,
    clear errors for a wrong input or size."""
    dense = zoo.Dense(3, 5, key=jr.key(0))
    assert dense.weight.shape == (3, 5) and dense.bias.shape == (5,)
    x = jr.normal(jr.key(1), (2, 3))
    expected = x @ dense.weight + dense.bias[None, :]
    assert jnp.allclose(dense(x), expected, rtol=1e-6, atol=1e-6)
    assert dense(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    assert zoo.Dense(3, 5, use_bias=False, key=jr.key(0)).bias is None
    with pytest.raises(ValueError, match=r"Dense expected x with last axis 3"):
        dense(jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="in_size"):
        zoo.Dense(0, 5, key=jr.key(0))


@pytest.mark.heavy
def test_llama():
    model = zoo.Transformer.llama(16, 8, 8, 2, 3, key=jr.key(0))
    assert (model.norm, model.position, model.mlp) == ("rms", "rope", "swiglu")
    assert model.num_kv_heads == 1 and model.attention == "dot_product"
    assert model.d_ff == 24  # 8/3 * 8, rounded up to a multiple of 8
    assert model.position_embedding is None and not model.use_bias
    assert model.blocks.qkv.bias is None and model.blocks.mlp_gate.bias is None
    # q: 2 heads, k and v: 1 head each, head_dim 4; stacked over 3 layers.
    assert model.blocks.qkv.weight.shape == (3, 8, 16)
    assert model.blocks.mlp_gate.weight.shape == (3, 8, 24)
    assert isinstance(model.final_norm, eqx.nn.RMSNorm)
    assert model.activation_names == (*NAMES[:-1], "mlp_gate", "mlp_out")
    # Its defaults at Llama-2's sizes (its shapes only: 90M parameters are
    # several seconds to initialise on two cores, and say nothing more).
    big = eqx.filter_eval_shape(
        zoo.Transformer.llama, 32000, 2048, 2048, 16, 1, key=jr.key(0)
    )
    assert (big.num_kv_heads, big.d_ff) == (4, 5632)
    tied = tiny(tie_embeddings=True)
    assert tied.head is None
    assert _forward(tied, TOKENS).shape == (2, 7, 16)


@pytest.mark.heavy
def test_swiglu_tags_both_hidden_projections():
    """`mlp_gate` and `mlp_hidden` each name a `(seq, d_ff)` projection of the
    SwiGLU MLP: saving either one saves one more stacked array than "nothing"."""
    layers, batch, seq = 3, 2, 7
    model = tiny(layers, mlp="swiglu", d_ff=12)

    def stacked(ck):
        res = er.residuals(loss, er.set_checkpoint(model, ck), TOKENS)
        return sorted(r.shape for r in res if r.shape[:3] == (layers, batch, seq))

    assert stacked("nothing") == [(layers, batch, seq, 8)]
    for name in ("mlp_gate", "mlp_hidden"):
        expected = sorted([(layers, batch, seq, 8), (layers, batch, seq, 12)])
        assert stacked(er.save_names(name)) == expected, name
    both = stacked(er.save_names("mlp_gate", "mlp_hidden"))
    assert both.count((layers, batch, seq, 12)) == 2


@pytest.mark.parametrize("ck", [None, "everything"], ids=["None", "everything"])
def test_no_transposed_weight_residuals(ck):
    """The saved residuals include no transposed copy of a stacked weight: the
    qkv weight is `(layers, d_model, 3 d_model)` = (3, 8, 24), and nothing of shape
    (3, 24, 8) is saved (a block computing `x @ W.T` would save it). The tied
    head contracts the `(vocab, d_model)` embedding without transposing it."""
    for tie in (False, True):
        model = er.set_checkpoint(tiny(3, tie_embeddings=tie), ck)
        shapes = [r.shape for r in er.residuals(loss, model, TOKENS)]
        assert (3, 24, 8) not in shapes
        if tie:
            assert (8, 16) not in shapes  # the embedding (16, 8), transposed


def test_count_flops_counts_pallas_kernels():
    """A Pallas kernel counts its `cost_estimate`; one without an estimate is
    listed in `FlopCount.unknown`."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    x = jnp.ones((8, 128), jnp.float32)

    def call(estimate):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            interpret=True,
            cost_estimate=estimate,
        )

    estimate = pl.CostEstimate(flops=1234, transcendentals=5, bytes_accessed=0)
    counted = er.count_flops(lambda x: call(estimate)(x) + 1.0, x)
    assert int(counted) == 1234 + x.size and counted.transcendentals == 5
    assert counted.unknown == {}
    uncounted = er.count_flops(lambda x: call(None)(x) + 1.0, x)
    assert int(uncounted) == x.size and uncounted.unknown == {"pallas_call": 1}
    # The flash kernels, forward and the two backward ones (to which the zoo
    # gives estimates), are all counted: nothing unknown. Per layer and example,
    # 2 heads of a 128-long tile (the 7 tokens, padded), head_dim 4: forward 2,
    # backward 7 products of 2 * 128 * 128 * 4 FLOPs.
    model = zoo.Transformer(16, 8, 8, 2, 2, attention="flash", key=jr.key(0))
    with flash_interpret():
        forward = er.count_flops(lambda m, t: jax.vmap(m)(t), model, TOKENS)
        backward = er.count_flops(eqx.filter_grad(loss), model, TOKENS)
    assert forward.unknown == {} and backward.unknown == {}
    xla = er.count_flops(lambda m, t: jax.vmap(m)(t), tiny(2), TOKENS)
    xla_grad = er.count_flops(eqx.filter_grad(loss), tiny(2), TOKENS)
    products = 2 * 2 * 2 * (2 * 128 * 128 * 4)  # layers * batch * heads * product
    assert int(forward) - int(xla) >= 2 * products - 2 * 2 * 2 * 2 * 2 * 7 * 7 * 4
    assert int(backward) - int(xla_grad) >= 7 * products - 6 * 2 * 2 * 2 * 2 * 7 * 7 * 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"attention": "splash"}, r"unknown attention 'splash'.*'flash'"),
        ({"norm": "batch"}, r"unknown norm 'batch'.*'rms'"),
        ({"position": "alibi"}, r"unknown position 'alibi'.*'rope'"),
        ({"mlp": "relu"}, r"unknown mlp 'relu'.*'swiglu'"),
        ({"num_kv_heads": 3}, r"num_heads must be divisible by num_kv_heads"),
        ({"num_kv_heads": 0}, r"num_kv_heads must be an int >= 1"),
        (
            {"d_model": 6, "num_heads": 2, "position": "rope"},
            r"position='rope' needs an even head dimension.*Got 6 // 2 = 3",
        ),
        ({"tie_embeddings": 1}, r"tie_embeddings must be a bool"),
    ],
    ids=["attention", "norm", "position", "mlp", "kv3", "kv0", "rope", "tie"],
)
def test_bad_options(kwargs, match):
    args = {"vocab_size": 16, "max_len": 8, "d_model": 8, "num_heads": 2}
    args.update(kwargs)
    with raises_bad_input(match, param=next(iter(kwargs))):
        zoo.Transformer(**args, num_layers=2, key=jr.key(0))


@pytest.mark.parametrize("ck", [None, "everything"], ids=["None", "everything"])
def test_gelu_saves_one_derivative(ck):
    """Without recomputation, each block keeps two `(seq, d_ff)` arrays for its
    GELU MLP: the GELU's output (for `mlp_out`'s weight gradient) and its
    derivative — not the tanh formula's intermediates (`jax.nn.gelu`
    differentiated as written left six, 4 x 8 MiB per layer more on the
    fit-a-budget model, which a plain scan saved for every layer)."""
    model = er.set_checkpoint(tiny(3), ck)  # d_ff 32
    shapes = [r.shape for r in er.residuals(loss, model, TOKENS)]
    assert shapes.count((3, 2, 7, 32)) == 2, shapes


def test_gelu_is_jax_gelu():
    """`zoo.gelu` is `jax.nn.gelu(approximate=True)`, and so is its derivative."""
    x = jnp.linspace(-6.0, 6.0, 101)
    assert jnp.array_equal(zoo.gelu(x), jax.nn.gelu(x))
    d = jax.vmap(jax.grad(zoo.gelu))(x)
    ref = jax.vmap(jax.grad(jax.nn.gelu))(x)
    np.testing.assert_allclose(d, ref, rtol=1e-5, atol=1e-6)

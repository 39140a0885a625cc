"""Peers: the models of the presets written by others, measured beside ours
(`of(preset)`). Each computes the zoo model's function on its weights, so its
loss equals ours up to rounding; the transformer peers use `zoo.gelu`.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import eqx_remat as er
import zoo

from . import _models


Make = Callable[..., tuple[Callable, Any]]  # (preset, model) -> (fn, params)


@dataclasses.dataclass(frozen=True)
class Peer:
    """Another implementation of a preset's model, measured beside ours."""

    impl: str  # whose: "hand-written", "flax", "eqxi.scan"
    checkpoint: str  # its own label, e.g. "dots", "treeverse(10)"
    ours: tuple[str, ...]  # the labels of our checkpoints it is compared with
    make: Make


# The policies the transformer peers are measured under (every one of ours).
TRANSFORMER_POLICIES = ("None", "everything", "dots", "dots_no_batch", "nothing")


def of(preset: _models.Preset, *, quick: bool) -> tuple[Peer, ...]:
    """The peers of `preset` (`quick`: only the transformer's `"dots"`)."""
    if isinstance(preset, _models.TransformerPreset):
        return tuple(
            Peer(impl, s, (s,), functools.partial(make, checkpoint=_checkpoint(s)))
            for impl, make in (
                ("hand-written", handwritten_transformer),
                ("flax", flax_transformer),
            )
            for s in (("dots",) if quick else TRANSFORMER_POLICIES)
        )
    if not (isinstance(preset, _models.ChainPreset) and preset.vmap):
        return ()
    slots = preset.treeverse or (max(1, math.ceil(math.log2(max(2, preset.layers)))),)
    nested = "nested-scan({}x{})".format(*nested_split(preset.layers))
    return (
        Peer("hand-written", "None", ("None",), _chain(_plain_scan)),
        Peer("hand-written", nested, ("nested(2)",), _chain(_nested_scan)),
    ) + tuple(
        Peer(
            "eqxi.scan",
            f"treeverse({s})",
            ("recursive()", f"binomial({s})"),
            _chain(functools.partial(_treeverse, checkpoints=s)),
        )
        for s in slots
    )


def _checkpoint(label: str) -> str | None:
    return None if label == "None" else label


# --------------------------------------------------------------------------------------
# Transformer peers: the zoo's `_Block`, restated, on the zoo model's weights in
# Flax's tree (`transformer_params`).


def transformer_params(model: Any) -> dict[str, Any]:
    """The zoo Transformer's weights in Flax linen's tree, layers stacked (the
    kernels are `(in, out)` in both)."""
    b = model.blocks

    def dense(layer: Any) -> dict[str, Any]:
        return {"kernel": layer.weight, "bias": layer.bias}

    def norm(layer: Any) -> dict[str, Any]:
        return {"scale": layer.weight, "bias": layer.bias}

    blocks = {"ln1": norm(b.attention_norm), "qkv": dense(b.qkv), "out": dense(b.out)}
    blocks |= {"ln2": norm(b.mlp_norm), "mlp_in": dense(b.mlp_in)}
    blocks |= {"mlp_out": dense(b.mlp_out)}
    return {
        "tok": model.token_embedding.weight,
        "pos": model.position_embedding.weight,
        "blocks": blocks,
        "lnf": norm(model.final_norm),
        "head": {"kernel": model.head.weight},
    }


def _layer_norm(p, name, x, eps=1e-5):  # the hand-written layers: p[name] on x
    p, x32 = p[name], x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.maximum(0.0, jnp.var(x32, axis=-1, keepdims=True))
    out = (x32 - mean) * lax.rsqrt(var + eps)
    scale, bias = p["scale"].astype(jnp.float32), p["bias"].astype(jnp.float32)
    return (scale * out + bias).astype(x.dtype)


def _dense(p, name, size, x):  # `size`: the weight's
    p = p[name]
    y = x @ p["kernel"].astype(x.dtype)
    return y + p["bias"].astype(x.dtype)[None, :] if "bias" in p else y


def _attention(qkv, heads):
    """Causal attention on a `(seq, 3 d_model)` projection (one example), laid
    out by head as the zoo's: each head's query, key and value."""
    seq, head_dim = qkv.shape[0], qkv.shape[1] // (3 * heads)
    qkv = qkv.reshape(seq, heads, 3, head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("qhd,khd->hqk", q, k).astype(jnp.float32)
    scores = scores / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(qkv.dtype)
    return jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, heads * head_dim)


def _block(x, norm, dense, attend, d_ff):
    """The zoo's `_Block`, its products named as the zoo names them, with a
    peer's layers: `norm(name, x)`, `dense(name, size, x)`, `attend(qkv)`."""
    d = x.shape[-1]
    x = checkpoint_name(x, "layer_input")
    qkv = checkpoint_name(dense("qkv", 3 * d, norm("ln1", x)), "qkv_proj")
    ctx = checkpoint_name(attend(qkv), "attention_context")
    x = x + checkpoint_name(dense("out", d, ctx), "out_proj")
    h = checkpoint_name(dense("mlp_in", d_ff, norm("ln2", x)), "mlp_hidden")
    return x + checkpoint_name(dense("mlp_out", d, zoo.gelu(h)), "mlp_out")


def handwritten_transformer(
    preset: _models.TransformerPreset, model: Any, checkpoint: str | None
) -> tuple[Callable, Any]:
    """`(fn, params)`: value_and_grad of the loss of the transformer written by
    hand, one example at a time under `jax.vmap`, its blocks applied with
    `lax.scan(jax.checkpoint(block, policy=er.policy(checkpoint),
    prevent_cse=False))` (no `jax.checkpoint` for `None`)."""
    dtype = jnp.dtype(preset.dtype)
    attend = functools.partial(_attention, heads=preset.heads)

    def block(x, p):  # one example: x is (seq, d_model)
        norm, dense = functools.partial(_layer_norm, p), functools.partial(_dense, p)
        return _block(x, norm, dense, attend, model.d_ff), None

    if (policy := er.policy(checkpoint)) is not None:
        block = jax.checkpoint(block, policy=policy, prevent_cse=False)

    def forward(a, tokens):
        x = (a["tok"][tokens] + a["pos"][: tokens.shape[0]]).astype(dtype)
        x = _layer_norm(a, "lnf", lax.scan(block, x, a["blocks"])[0])
        return _dense(a, "head", preset.vocab, x).astype(jnp.float32)

    def loss(a, tokens):
        logits = jax.vmap(forward, in_axes=(None, 0))(a, tokens)
        return _models.cross_entropy(logits, tokens)

    return jax.value_and_grad(loss), transformer_params(model)


def _flax_lm(preset: _models.TransformerPreset, d_ff: int, policy: Any) -> Any:
    """The transformer as Flax linen modules, batch-major, blocks stacked with
    `nn.scan(nn.remat(Block, policy=policy, prevent_cse=False))`."""
    import flax.linen as nn

    dtype = jnp.dtype(preset.dtype)
    attend = jax.vmap(functools.partial(_attention, heads=preset.heads))

    def norm(name, x):
        return nn.LayerNorm(
            epsilon=1e-5, dtype=dtype, use_fast_variance=False, name=name
        )(x)

    def dense(name, n, x):
        return nn.Dense(n, dtype=dtype, name=name)(x)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):  # a batch: x is (batch, seq, d_model)
            return _block(x, norm, dense, attend, d_ff), None

    block = (
        Block if policy is None else nn.remat(Block, policy=policy, prevent_cse=False)
    )
    stack = nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=preset.layers,
    )

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            init = nn.initializers.zeros
            tok = self.param("tok", init, (preset.vocab, preset.d_model))
            pos = self.param("pos", init, (preset.seq, preset.d_model))
            x = (tok[tokens] + pos[None, : tokens.shape[1]]).astype(dtype)
            x, _ = stack(name="blocks")(x, None)
            head = nn.Dense(preset.vocab, use_bias=False, dtype=dtype, name="head")
            return head(norm("lnf", x)).astype(jnp.float32)

    return LM()


def flax_transformer(
    preset: _models.TransformerPreset, model: Any, checkpoint: str | None
) -> tuple[Callable, Any]:
    """`(fn, params)`: value_and_grad of the loss of the transformer in Flax linen
    (`_flax_lm`), with the zoo model's weights. Raises `AssertionError` where
    the two trees of weights differ."""
    lm = _flax_lm(preset, model.d_ff, er.policy(checkpoint))
    params = transformer_params(model)
    tokens = jnp.zeros((1, preset.seq), jnp.int32)
    expected = jax.eval_shape(lm.init, jax.random.key(0), tokens)["params"]
    if jax.tree.structure(expected) != jax.tree.structure(params):
        raise AssertionError(
            f"Flax params do not match: {jax.tree.structure(expected)} vs "
            f"{jax.tree.structure(params)}"
        )

    def loss(p, tokens):
        return _models.cross_entropy(lm.apply({"params": p}, tokens), tokens)

    return jax.value_and_grad(loss), params


# --------------------------------------------------------------------------------------
# ResidualChain peers, batch-major: `run(layer, p, x)` applies the layers.


def _chain(run: Callable) -> Make:
    """A chain peer: value_and_grad of the mean square of `run(layer, p, x)`, on
    the zoo chain's stacked weight and bias `p`."""

    def make(preset: _models.ChainPreset, model: Any) -> tuple[Callable, Any]:
        step = 1.0 / preset.depth

        def layer(x, p):
            w, b = p  # `equinox.nn.Linear`'s: the weight is (out, in)
            return x + step * jnp.tanh(x @ w.T + b[None, :]), None

        def loss(p, x):
            return jnp.mean(run(layer, p, x) ** 2)

        linear = model.layers.linear
        return jax.value_and_grad(loss), (linear.weight, linear.bias)

    return make


def _plain_scan(layer, p, x):
    """One `lax.scan`, no checkpointing."""
    return lax.scan(layer, x, p)[0]


def _treeverse(layer, p, x, checkpoints):
    """`equinox.internal.scan(kind="checkpointed")`: online treeverse with
    `checkpoints` stored carries."""
    return eqxi.scan(layer, x, p, kind="checkpointed", checkpoints=checkpoints)[0]


def nested_split(depth: int) -> tuple[int, int]:
    """`(outer, inner)` with `outer * inner == depth`, both as close to √depth as
    divisors allow (the √D split of a 2-level nested scan)."""
    inner = max(d for d in range(1, math.isqrt(depth) + 1) if depth % d == 0)
    return depth // inner, inner


def _nested_scan(layer, p, x):
    """A 2-level nested `lax.scan`: `outer` segments of `inner` layers, each
    segment under `jax.checkpoint` (the √D schedule written by hand)."""
    outer, inner = nested_split(p[0].shape[0])

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def segment(x, p):
        return lax.scan(layer, x, p)[0], None

    p = jax.tree.map(lambda a: a.reshape(outer, inner, *a.shape[1:]), p)
    return lax.scan(segment, x, p)[0]

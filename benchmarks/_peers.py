"""Peers: the same models written by others, measured beside ours (`of(preset)`
lists a preset's). Each computes the same function as the zoo model on the same
weights (taken from the zoo model's arrays), so its loss equals ours up to float
rounding; the transformer peers use the zoo's activation, `zoo.gelu`, so that
the programs differ in how the layers are stacked and checkpointed, not in the
model.
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


@dataclasses.dataclass(frozen=True)
class Peer:
    """Another implementation of a preset's model, measured beside ours."""

    impl: str  # whose: "hand-written", "flax", "eqxi.scan"
    checkpoint: str  # its own label, e.g. "dots", "treeverse(10)"
    ours: tuple[str, ...]  # the labels of our checkpoints it is compared with
    make: Callable[[Any, Any], tuple[Callable, Any]]


# The policies the transformer peers are measured under (every one of ours).
TRANSFORMER_POLICIES = ("None", "everything", "dots", "dots_no_batch", "nothing")


def of(preset: _models.Preset, *, quick: bool) -> tuple[Peer, ...]:
    """The peers of `preset` (`quick`: only the transformer's `"dots"`)."""
    if isinstance(preset, _models.TransformerPreset):
        return _transformer_peers(quick)
    if isinstance(preset, _models.ChainPreset) and preset.vmap:
        return _chain_peers(preset)
    return ()


def _transformer_peers(quick: bool) -> tuple[Peer, ...]:
    makers = (("hand-written", handwritten_transformer), ("flax", flax_transformer))
    return tuple(
        Peer(
            impl,
            s,
            (s,),
            functools.partial(make, checkpoint=None if s == "None" else s),
        )
        for impl, make in makers
        for s in (("dots",) if quick else TRANSFORMER_POLICIES)
    )


def _chain_peers(preset: _models.ChainPreset) -> tuple[Peer, ...]:
    log2 = max(1, math.ceil(math.log2(max(2, preset.layers))))
    nested = "nested-scan({}x{})".format(*nested_split(preset.layers))
    return (
        Peer("hand-written", "None", ("None",), plain_scan_chain),
        Peer("hand-written", nested, ("nested(2)",), nested_scan_chain),
    ) + tuple(
        Peer(
            "eqxi.scan",
            f"treeverse({s})",
            ("recursive()", f"binomial({s})"),
            functools.partial(treeverse_chain, checkpoints=s),
        )
        for s in (preset.treeverse or (log2,))
    )


# --------------------------------------------------------------------------------------
# Transformer peers. The math is the zoo's `_Block`, restated.


def _layer_norm(x, weight, bias, eps=1e-5):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.maximum(0.0, jnp.var(x32, axis=-1, keepdims=True))
    out = (x32 - mean) * lax.rsqrt(var + eps)
    return (weight.astype(jnp.float32) * out + bias.astype(jnp.float32)).astype(x.dtype)


def _linear(x, weight, bias=None):
    y = x @ weight.astype(x.dtype)
    if bias is not None:
        y = y + bias.astype(x.dtype)[None, :]
    return y


def _attention(qkv, seq, heads, head_dim, dtype):
    """Causal attention on a `(seq, 3 d_model)` projection (one example)."""
    q, k, v = jnp.split(qkv.reshape(seq, 3, heads, head_dim), 3, 1)
    q, k, v = q[:, 0], k[:, 0], v[:, 0]
    scores = jnp.einsum("qhd,khd->hqk", q, k).astype(jnp.float32)
    scores = scores / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, heads * head_dim)


def transformer_arrays(model: Any) -> dict[str, Any]:
    """The zoo Transformer's weights as a plain dict of arrays (layers stacked)."""
    b = model.blocks
    return {
        "tok": model.token_embedding.weight,
        "pos": model.position_embedding.weight,
        "blocks": {
            "ln1_w": b.attention_norm.weight,
            "ln1_b": b.attention_norm.bias,
            "qkv_w": b.qkv.weight,
            "qkv_b": b.qkv.bias,
            "out_w": b.out.weight,
            "out_b": b.out.bias,
            "ln2_w": b.mlp_norm.weight,
            "ln2_b": b.mlp_norm.bias,
            "in_w": b.mlp_in.weight,
            "in_b": b.mlp_in.bias,
            "mlp_w": b.mlp_out.weight,
            "mlp_b": b.mlp_out.bias,
        },
        "lnf_w": model.final_norm.weight,
        "lnf_b": model.final_norm.bias,
        "head_w": model.head.weight,
    }


def handwritten_transformer(
    preset: _models.TransformerPreset, model: Any, checkpoint: str | None
) -> tuple[Callable, Any]:
    """`(fn, arrays)`: value_and_grad of the loss of the transformer written by
    hand: one example at a time, vmapped, blocks applied with
    `lax.scan(jax.checkpoint(block, policy=er.policy(checkpoint),
    prevent_cse=False))` (no `jax.checkpoint` for `None`)."""
    heads, dtype = preset.heads, jnp.dtype(preset.dtype)
    pol = er.policy(checkpoint)

    def block(x, p):
        seq, d = x.shape
        x = checkpoint_name(x, "layer_input")
        h = _layer_norm(x, p["ln1_w"], p["ln1_b"])
        qkv = checkpoint_name(_linear(h, p["qkv_w"], p["qkv_b"]), "qkv_proj")
        ctx = _attention(qkv, seq, heads, d // heads, x.dtype)
        ctx = checkpoint_name(ctx, "attention_context")
        x = x + checkpoint_name(_linear(ctx, p["out_w"], p["out_b"]), "out_proj")
        h = _layer_norm(x, p["ln2_w"], p["ln2_b"])
        h = checkpoint_name(_linear(h, p["in_w"], p["in_b"]), "mlp_hidden")
        m = _linear(zoo.gelu(h), p["mlp_w"], p["mlp_b"])
        return x + checkpoint_name(m, "mlp_out"), None

    if pol is not None:
        block = jax.checkpoint(block, policy=pol, prevent_cse=False)

    def forward(a, tokens):
        seq = tokens.shape[0]
        x = (a["tok"][tokens] + a["pos"][:seq]).astype(dtype)
        x = lax.scan(block, x, a["blocks"])[0]
        x = _layer_norm(x, a["lnf_w"], a["lnf_b"])
        return _linear(x, a["head_w"]).astype(jnp.float32)

    def loss(a, tokens):
        return _models.cross_entropy(
            jax.vmap(forward, in_axes=(None, 0))(a, tokens), tokens
        )

    return jax.value_and_grad(loss), transformer_arrays(model)


def _flax_lm(preset: _models.TransformerPreset, d_ff: int, pol: Any) -> Any:
    """The transformer as Flax linen modules, batch-major, blocks stacked with
    `nn.scan(nn.remat(Block, policy=pol, prevent_cse=False))`."""
    import flax.linen as nn

    dtype, heads = jnp.dtype(preset.dtype), preset.heads

    def norm(name):
        return nn.LayerNorm(
            epsilon=1e-5, dtype=dtype, use_fast_variance=False, name=name
        )

    def dense(n, name, tag, x):
        return checkpoint_name(nn.Dense(n, dtype=dtype, name=name)(x), tag)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            b, seq, d = x.shape
            x = checkpoint_name(x, "layer_input")
            qkv = dense(3 * d, "qkv", "qkv_proj", norm("ln1")(x))
            ctx = jax.vmap(lambda t: _attention(t, seq, heads, d // heads, dtype))(qkv)
            ctx = checkpoint_name(ctx, "attention_context")
            x = x + dense(d, "out", "out_proj", ctx)
            h = dense(d_ff, "mlp_in", "mlp_hidden", norm("ln2")(x))
            m = nn.Dense(d, dtype=dtype, name="mlp_out")(zoo.gelu(h))
            return x + checkpoint_name(m, "mlp_out"), None

    block = Block if pol is None else nn.remat(Block, policy=pol, prevent_cse=False)
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
            return head(norm("lnf")(x)).astype(jnp.float32)

    return LM()


def _flax_params(a: dict[str, Any]) -> dict[str, Any]:
    """`transformer_arrays` in Flax's tree (the kernels are `(in, out)` in both)."""
    bl = a["blocks"]

    def dense(w, b):
        return {"kernel": bl[w], "bias": bl[b]}

    return {
        "tok": a["tok"],
        "pos": a["pos"],
        "blocks": {
            "ln1": {"scale": bl["ln1_w"], "bias": bl["ln1_b"]},
            "qkv": dense("qkv_w", "qkv_b"),
            "out": dense("out_w", "out_b"),
            "ln2": {"scale": bl["ln2_w"], "bias": bl["ln2_b"]},
            "mlp_in": dense("in_w", "in_b"),
            "mlp_out": dense("mlp_w", "mlp_b"),
        },
        "lnf": {"scale": a["lnf_w"], "bias": a["lnf_b"]},
        "head": {"kernel": a["head_w"]},
    }


def flax_transformer(
    preset: _models.TransformerPreset, model: Any, checkpoint: str | None
) -> tuple[Callable, Any]:
    """`(fn, params)`: value_and_grad of the loss of the transformer in Flax linen
    (`_flax_lm`), with the zoo model's weights."""
    lm = _flax_lm(preset, model.d_ff, er.policy(checkpoint))
    params = _flax_params(transformer_arrays(model))
    expected = jax.eval_shape(
        lm.init, jax.random.key(0), jnp.zeros((1, preset.seq), jnp.int32)
    )["params"]
    if jax.tree.structure(expected) != jax.tree.structure(params):
        raise AssertionError(
            f"Flax params do not match: {jax.tree.structure(expected)} vs "
            f"{jax.tree.structure(params)}"
        )

    def loss(p, tokens):
        return _models.cross_entropy(lm.apply({"params": p}, tokens), tokens)

    return jax.value_and_grad(loss), params


# --------------------------------------------------------------------------------------
# ResidualChain peers (batch-major, like a user would write them).


def chain_arrays(model: Any) -> tuple[jax.Array, jax.Array]:
    return model.layers.linear.weight, model.layers.linear.bias


def _chain_layer(depth: int):
    step = 1.0 / depth

    def layer(x, p):
        w, b = p  # `equinox.nn.Linear`'s: the weight is (out, in)
        return x + step * jnp.tanh(x @ w.T + b[None, :]), None

    return layer


def _chain_loss(run: Callable) -> Callable:
    return jax.value_and_grad(lambda p, x: jnp.mean(run(p, x) ** 2))


def plain_scan_chain(preset: _models.ChainPreset, model: Any) -> tuple[Callable, Any]:
    """One batch-major `lax.scan`, no checkpointing."""
    layer = _chain_layer(preset.depth)
    return _chain_loss(lambda p, x: lax.scan(layer, x, p)[0]), chain_arrays(model)


def treeverse_chain(
    preset: _models.ChainPreset, model: Any, checkpoints: int
) -> tuple[Callable, Any]:
    """`equinox.internal.scan(kind="checkpointed", checkpoints=checkpoints)`:
    online treeverse with that many stored carries."""
    layer = _chain_layer(preset.depth)

    def run(p, x):
        return eqxi.scan(layer, x, p, kind="checkpointed", checkpoints=checkpoints)[0]

    return _chain_loss(run), chain_arrays(model)


def nested_split(depth: int) -> tuple[int, int]:
    """`(outer, inner)` with `outer * inner == depth`, both as close to √depth as
    divisors allow (the √D split of a 2-level nested scan)."""
    inner = max(d for d in range(1, math.isqrt(depth) + 1) if depth % d == 0)
    return depth // inner, inner


def nested_scan_chain(preset: _models.ChainPreset, model: Any) -> tuple[Callable, Any]:
    """A 2-level nested `lax.scan`: `outer` segments of `inner` layers, each
    segment under `jax.checkpoint` (the √D schedule written by hand)."""
    outer, inner = nested_split(preset.depth)
    layer = _chain_layer(preset.depth)

    def segment(x, p):
        return lax.scan(layer, x, p)[0], None

    segment = jax.checkpoint(segment, prevent_cse=False)

    def run(p, x):
        p = jax.tree.map(lambda a: a.reshape(outer, inner, *a.shape[1:]), p)
        return lax.scan(segment, x, p)[0]

    return _chain_loss(run), chain_arrays(model)

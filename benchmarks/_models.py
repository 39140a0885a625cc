"""Presets, losses, and the peers the zoo models are measured against.

Each peer computes the same function as the zoo model, on the same weights (taken
from the zoo model's arrays), so its loss equals ours up to float rounding:

- `handwritten_transformer`: the transformer written as plain functions, one
  example at a time (vmapped over the batch, like the zoo), its blocks applied
  with `lax.scan(jax.checkpoint(block, policy=...))`;
- `flax_transformer`: the same, as Flax linen modules, batch-major (the way a
  Flax user writes it), blocks stacked with `nn.scan(nn.remat(Block, policy=...))`;
- `treeverse_chain`: the ResidualChain with `equinox.internal.scan(...,
  kind="checkpointed", checkpoints=c)` (online treeverse);
- `nested_scan_chain`: the ResidualChain as a 2-level nested `lax.scan`, the
  outer body under `jax.checkpoint` (the √D schedule by hand);
- `plain_scan_chain`: the ResidualChain as one batch-major `lax.scan`.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import eqx_remat as er
import zoo


# --------------------------------------------------------------------------------------
# Presets.


@dataclasses.dataclass(frozen=True)
class TransformerPreset:
    vocab: int
    seq: int
    d_model: int
    heads: int
    layers: int
    batch: int
    dtype: str = "float32"
    d_ff: int | None = None

    kind = "transformer"

    def describe(self) -> str:
        return (
            f"zoo.Transformer vocab {self.vocab}, d_model {self.d_model}, "
            f"{self.heads} heads, {self.layers} layers, seq {self.seq}, "
            f"batch {self.batch}, {self.dtype}"
        )

    @property
    def depth(self) -> int:
        return self.layers


@dataclasses.dataclass(frozen=True)
class ChainPreset:
    width: int
    depth: int
    batch: int

    kind = "chain"

    def describe(self) -> str:
        return (
            f"zoo.ResidualChain width {self.width}, depth {self.depth}, "
            f"batch {self.batch}, float32"
        )


@dataclasses.dataclass(frozen=True)
class MLPPreset:
    size: int
    width: int
    depth: int
    batch: int

    kind = "mlp"

    def describe(self) -> str:
        return (
            f"zoo.MLP {self.size} -> {self.width} x {self.depth} -> {self.size}, "
            f"batch {self.batch}, float32"
        )


PRESETS: dict[str, Any] = {
    # The default CPU sweep: small enough to compile and run ~40 variants in a
    # few minutes on 2 cores, big enough that the residuals dominate memory.
    "transformer-s": TransformerPreset(256, 128, 128, 4, 8, 4),
    "chain-s": ChainPreset(32, 1024, 256),
    "mlp-s": MLPPreset(64, 256, 32, 128),
    # Heavier CPU presets.
    "transformer-m": TransformerPreset(1024, 256, 256, 8, 12, 8),
    "chain-m": ChainPreset(128, 1024, 256),
    # For --target v5e: per-chip memory of models that leave VMEM.
    "transformer-v5e": TransformerPreset(32000, 2048, 1024, 8, 16, 8, "bfloat16"),
    # Activations dominate (batch per chip / width = 4), as on the CPU presets ...
    "chain-v5e": ChainPreset(256, 1024, 4096),
    # ... and parameters dominate (1/16): 4 GiB of weights, 256 KiB carries.
    "chain-v5e-params": ChainPreset(1024, 1024, 256),
    # End-to-end smoke test (--quick).
    "transformer-tiny": TransformerPreset(64, 16, 32, 2, 2, 2),
    "chain-tiny": ChainPreset(8, 16, 2),
}

DEFAULT_PRESETS = ("transformer-s", "chain-s", "mlp-s")
V5E_PRESETS = ("transformer-v5e", "chain-v5e", "chain-v5e-params")
QUICK_PRESETS = ("transformer-tiny", "chain-tiny")


# --------------------------------------------------------------------------------------
# Models and losses (ours).


def build(preset: Any, checkpoint: er.Checkpoint = None, *, abstract: bool = False):
    """The zoo model of a preset, with `checkpoint`. `abstract`: only shapes
    (`eqx.filter_eval_shape`, nothing allocated)."""
    key = jax.random.key(0)
    if preset.kind == "transformer":

        def make():
            return zoo.Transformer(
                preset.vocab,
                preset.seq,
                preset.d_model,
                preset.heads,
                preset.layers,
                d_ff=preset.d_ff,
                dtype=jnp.dtype(preset.dtype),
                checkpoint=checkpoint,
                key=key,
            )

    elif preset.kind == "chain":

        def make():
            return zoo.ResidualChain(
                preset.width, preset.depth, checkpoint=checkpoint, key=key
            )

    else:

        def make():
            return zoo.MLP(
                preset.size,
                preset.size,
                preset.width,
                preset.depth,
                checkpoint=checkpoint,
                key=key,
            )

    return eqx.filter_eval_shape(make) if abstract else make()


def batch(preset: Any, *, abstract: bool = False) -> Any:
    """A batch for a preset: token ids or inputs, with a leading batch axis."""
    key = jax.random.key(1)
    if preset.kind == "transformer":
        shape, dtype = (preset.batch, preset.seq), jnp.int32
        if abstract:
            return jax.ShapeDtypeStruct(shape, dtype)
        return jax.random.randint(key, shape, 0, preset.vocab, dtype=dtype)
    size = preset.width if preset.kind == "chain" else preset.size
    shape = (preset.batch, size)
    if abstract:
        return jax.ShapeDtypeStruct(shape, jnp.float32)
    return jax.random.normal(key, shape, jnp.float32)


def cross_entropy(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy; `logits` `(batch, seq, vocab)`."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def loss_fn(preset: Any) -> Callable[[Any, jax.Array], jax.Array]:
    """`loss(model, batch)` with the model applied per example under `jax.vmap`
    (the Equinox convention)."""
    if preset.kind == "transformer":
        return lambda model, tokens: cross_entropy(jax.vmap(model)(tokens), tokens)
    return lambda model, x: jnp.mean(jax.vmap(model)(x) ** 2)


def is_arraylike(x: Any) -> bool:
    """Arrays and `jax.ShapeDtypeStruct`s (abstract models): what is
    differentiated."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def ours(preset: Any, model: Any, checkpoint: er.Checkpoint) -> tuple[Callable, Any]:
    """`(fn, params)`: `fn(params, batch) = value_and_grad(loss)` of the zoo model
    with `checkpoint`, differentiated with respect to its arrays `params`."""
    params, static = eqx.partition(er.set_checkpoint(model, checkpoint), is_arraylike)
    loss = loss_fn(preset)
    return jax.value_and_grad(lambda p, b: loss(eqx.combine(p, static), b)), params


# --------------------------------------------------------------------------------------
# Transformer peers. The math is the zoo's `_Block`, restated.


def _layer_norm(x, weight, bias, eps=1e-5):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.maximum(0.0, jnp.var(x32, axis=-1, keepdims=True))
    out = (x32 - mean) * lax.rsqrt(var + eps)
    return (weight.astype(jnp.float32) * out + bias.astype(jnp.float32)).astype(x.dtype)


def _linear(x, weight, bias=None):
    y = x @ weight.T.astype(x.dtype)
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
    preset: TransformerPreset, model: Any, checkpoint: str | None
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
        m = _linear(jax.nn.gelu(h), p["mlp_w"], p["mlp_b"])
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
        return cross_entropy(jax.vmap(forward, in_axes=(None, 0))(a, tokens), tokens)

    return jax.value_and_grad(loss), transformer_arrays(model)


def flax_transformer(
    preset: TransformerPreset, model: Any, checkpoint: str | None
) -> tuple[Callable, Any]:
    """`(fn, params)`: value_and_grad of the loss of the transformer as Flax linen
    modules (batch-major), blocks stacked with `nn.scan(nn.remat(Block,
    policy=er.policy(checkpoint), prevent_cse=False))` (no `nn.remat` for
    `None`), with the zoo model's weights."""
    import flax.linen as nn

    dtype = jnp.dtype(preset.dtype)
    heads = preset.heads

    def norm(name):
        return nn.LayerNorm(
            epsilon=1e-5, dtype=dtype, use_fast_variance=False, name=name
        )

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            b, seq, d = x.shape
            x = checkpoint_name(x, "layer_input")
            h = norm("ln1")(x)
            qkv = checkpoint_name(
                nn.Dense(3 * d, dtype=dtype, name="qkv")(h), "qkv_proj"
            )
            ctx = jax.vmap(lambda t: _attention(t, seq, heads, d // heads, dtype))(qkv)
            ctx = checkpoint_name(ctx, "attention_context")
            a = checkpoint_name(nn.Dense(d, dtype=dtype, name="out")(ctx), "out_proj")
            x = x + a
            h = norm("ln2")(x)
            ff = model.d_ff
            h = checkpoint_name(
                nn.Dense(ff, dtype=dtype, name="mlp_in")(h), "mlp_hidden"
            )
            m = nn.Dense(d, dtype=dtype, name="mlp_out")(jax.nn.gelu(h))
            return x + checkpoint_name(m, "mlp_out"), None

    pol = er.policy(checkpoint)
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
            x = norm("lnf")(x)
            head = nn.Dense(preset.vocab, use_bias=False, dtype=dtype, name="head")
            return head(x).astype(jnp.float32)

    lm = LM()
    a = transformer_arrays(model)
    bl = a["blocks"]

    def t(w):  # eqx Linear (out, in) -> Dense (in, out)
        if isinstance(w, jax.ShapeDtypeStruct):
            shape = (*w.shape[:-2], w.shape[-1], w.shape[-2])
            return jax.ShapeDtypeStruct(shape, w.dtype)
        return jnp.swapaxes(w, -1, -2)

    params = {
        "tok": a["tok"],
        "pos": a["pos"],
        "blocks": {
            "ln1": {"scale": bl["ln1_w"], "bias": bl["ln1_b"]},
            "qkv": {"kernel": t(bl["qkv_w"]), "bias": bl["qkv_b"]},
            "out": {"kernel": t(bl["out_w"]), "bias": bl["out_b"]},
            "ln2": {"scale": bl["ln2_w"], "bias": bl["ln2_b"]},
            "mlp_in": {"kernel": t(bl["in_w"]), "bias": bl["in_b"]},
            "mlp_out": {"kernel": t(bl["mlp_w"]), "bias": bl["mlp_b"]},
        },
        "lnf": {"scale": a["lnf_w"], "bias": a["lnf_b"]},
        "head": {"kernel": t(a["head_w"])},
    }
    expected = jax.eval_shape(
        lm.init, jax.random.key(0), jnp.zeros((1, preset.seq), jnp.int32)
    )["params"]
    if jax.tree.structure(expected) != jax.tree.structure(params):
        raise AssertionError(
            f"Flax params do not match: {jax.tree.structure(expected)} vs "
            f"{jax.tree.structure(params)}"
        )

    def loss(p, tokens):
        return cross_entropy(lm.apply({"params": p}, tokens), tokens)

    return jax.value_and_grad(loss), params


# --------------------------------------------------------------------------------------
# ResidualChain peers (batch-major, like a user would write them).


def chain_arrays(model: Any) -> tuple[jax.Array, jax.Array]:
    return model.layers.linear.weight, model.layers.linear.bias


def _chain_layer(depth: int):
    step = 1.0 / depth

    def layer(x, p):
        w, b = p
        return x + step * jnp.tanh(_linear(x, w, b)), None

    return layer


def _chain_loss(run: Callable) -> Callable:
    return jax.value_and_grad(lambda p, x: jnp.mean(run(p, x) ** 2))


def plain_scan_chain(preset: ChainPreset, model: Any) -> tuple[Callable, Any]:
    """One batch-major `lax.scan`, no checkpointing."""
    layer = _chain_layer(preset.depth)
    return _chain_loss(lambda p, x: lax.scan(layer, x, p)[0]), chain_arrays(model)


def treeverse_chain(
    preset: ChainPreset, model: Any, checkpoints: int
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


def nested_scan_chain(preset: ChainPreset, model: Any) -> tuple[Callable, Any]:
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

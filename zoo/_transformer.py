import math
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from beartype import beartype
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, PRNGKeyArray, jaxtyped

import eqx_remat

from ._util import check_checkpoint, check_int


def _dense(linear: eqx.nn.Linear, x: Array) -> Array:
    """`linear` applied to each row of `x`, computed in `x.dtype`.

    The parameters stay in their own dtype (float32) and are cast here, inside the
    layer, so a low-precision compute dtype never materialises a second copy of the
    whole stack's weights.
    """
    y = x @ linear.weight.T.astype(x.dtype)
    if linear.bias is not None:
        y = y + linear.bias.astype(x.dtype)[None, :]
    return y


class _Block(eqx.Module):
    """One pre-norm decoder block: causal self-attention, then a GELU MLP."""

    attention_norm: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    mlp_norm: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    num_heads: int = eqx.field(static=True)

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float, *, key):
        qkey, okey, ikey, mkey = jr.split(key, 4)
        self.attention_norm = eqx.nn.LayerNorm(d_model)
        self.qkv = eqx.nn.Linear(d_model, 3 * d_model, key=qkey)
        self.out = eqx.nn.Linear(d_model, d_model, key=okey)
        self.mlp_norm = eqx.nn.LayerNorm(d_model)
        self.mlp_in = eqx.nn.Linear(d_model, d_ff, key=ikey)
        self.mlp_out = eqx.nn.Linear(d_ff, d_model, key=mkey)
        self.dropout = eqx.nn.Dropout(dropout)
        self.num_heads = num_heads

    def __call__(self, x: Array, key: Array | None = None) -> Array:
        seq, d_model = x.shape
        head_dim = d_model // self.num_heads
        akey, mkey = (None, None) if key is None else jr.split(key)
        x = checkpoint_name(x, "layer_input")

        # Causal multi-head self-attention. Scores and softmax in float32.
        with jax.named_scope("attention"):
            h = jax.vmap(self.attention_norm)(x)
            qkv = checkpoint_name(_dense(self.qkv, h), "qkv_proj")
            q, k, v = jnp.split(qkv.reshape(seq, 3, self.num_heads, head_dim), 3, 1)
            q, k, v = q[:, 0], k[:, 0], v[:, 0]
            scores = jnp.einsum("qhd,khd->hqk", q, k).astype(jnp.float32)
            scores = scores / math.sqrt(head_dim)
            causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
            scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
            weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
            context = jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, d_model)
            context = checkpoint_name(context, "attention_context")
            a = checkpoint_name(_dense(self.out, context), "out_proj")
            x = x + self.dropout(a, key=akey)

        with jax.named_scope("mlp"):
            h = jax.vmap(self.mlp_norm)(x)
            h = checkpoint_name(_dense(self.mlp_in, h), "mlp_hidden")
            m = checkpoint_name(_dense(self.mlp_out, jax.nn.gelu(h)), "mlp_out")
            x = x + self.dropout(m, key=mkey)
        return x


class Transformer(eqx.Module):
    """A decoder-only causal language model (GPT-2 style), its blocks stacked and
    scanned with [`eqx_remat.scan_layers`][] and checkpointed by `checkpoint`.

    - Token embeddings plus learned position embeddings, then `num_layers`
      pre-norm blocks `x + attention(norm(x))`, `x + mlp(norm(x))`; a final norm
      and an output head.
    - Norms are `LayerNorm` (with weight and bias), computed in float32.
    - Multi-head causal self-attention with a fused `qkv` projection; the scores
      and softmax are computed in float32.
    - The MLP is `d_model -> d_ff -> d_model` with a (tanh-approximated) GELU.
    - The output head is **untied**: a separate `d_model -> vocab_size` linear map
      without bias, not the transpose of the token embedding.
    - Dropout (`dropout > 0`) is applied to the embeddings and to the output of
      each attention and MLP branch (not to the attention weights). The `key` of
      `__call__` is split into one key per layer, passed to the scan as per-layer
      inputs: every checkpointing schedule regenerates the same masks when it
      recomputes a layer, and masks are recomputed rather than saved.
      `equinox.nn.inference_mode(model)` turns dropout off.

    Intermediates are tagged with `jax.ad_checkpoint.checkpoint_name`, one tag per
    name in `Transformer.ACTIVATION_NAMES`, so that name-based policies
    ([`eqx_remat.save_names`][], [`eqx_remat.offload_names`][], ...) select them:

    | name | value, per example | shape |
    |---|---|---|
    | `layer_input` | a block's input | `(seq, d_model)` |
    | `qkv_proj` | the fused query/key/value projection | `(seq, 3 d_model)` |
    | `attention_context` | attention-weighted values, heads merged | `(seq, d_model)` |
    | `out_proj` | the attention output projection | `(seq, d_model)` |
    | `mlp_hidden` | the MLP's hidden pre-activation (before GELU) | `(seq, d_ff)` |
    | `mlp_out` | the MLP's output projection | `(seq, d_model)` |
    """

    ACTIVATION_NAMES: ClassVar[tuple[str, ...]] = (
        "layer_input",
        "qkv_proj",
        "attention_context",
        "out_proj",
        "mlp_hidden",
        "mlp_out",
    )

    token_embedding: eqx.nn.Embedding
    position_embedding: eqx.nn.Embedding
    embedding_dropout: eqx.nn.Dropout
    blocks: _Block
    final_norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    vocab_size: int = eqx.field(static=True)
    max_len: int = eqx.field(static=True)
    d_model: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)
    d_ff: int = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    dtype: np.dtype = eqx.field(static=True)
    checkpoint: eqx_remat.Checkpoint = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        *,
        d_ff: int | None = None,
        dropout: float = 0.0,
        dtype: Any = None,
        checkpoint: eqx_remat.Checkpoint = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `vocab_size`: the number of token ids; tokens are ints in
          `[0, vocab_size)`.
        - `max_len`: the longest sequence the position embedding covers.
        - `d_model`: the width of the residual stream.
        - `num_heads`: the number of attention heads; must divide `d_model`.
        - `num_layers`: the number of decoder blocks (stacked and scanned); >= 1.
        - `d_ff`: the hidden size of each block's MLP. Default `4 * d_model`.
        - `dropout`: the dropout rate, in `[0, 1)`. Default `0.0` (no dropout).
        - `dtype`: the compute dtype of the activations and matrix multiplies,
          e.g. `jnp.bfloat16`. Parameters are always float32 (and are cast inside
          each layer); norms, attention softmax and the returned logits are
          float32. Default `None`: float32 throughout.
        - `checkpoint`: how the stack of blocks is checkpointed: `None`, a policy
          or its name, or a schedule (see [`eqx_remat.scan_layers`][]).
        - `key`: a `jax.random` key for the initialisation. (Keyword only.)
        """
        cls = "Transformer"
        for name, value in (
            ("vocab_size", vocab_size),
            ("max_len", max_len),
            ("d_model", d_model),
            ("num_heads", num_heads),
            ("num_layers", num_layers),
        ):
            check_int(cls, name, value, 1)
        if d_model % num_heads != 0:
            raise ValueError(
                f"{cls}: d_model must be divisible by num_heads. "
                f"Got d_model={d_model}, num_heads={num_heads}."
            )
        if d_ff is None:
            d_ff = 4 * d_model
        check_int(cls, "d_ff", d_ff, 1)
        if (
            isinstance(dropout, bool)
            or not isinstance(dropout, (int, float))
            or not 0 <= dropout < 1
        ):
            raise ValueError(f"{cls}: dropout must be in [0, 1). Got {dropout!r}.")
        try:
            dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
        except TypeError:
            raise ValueError(
                f"{cls}: dtype must be a floating dtype such as jnp.bfloat16. "
                f"Got {dtype!r}."
            ) from None
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{cls}: dtype must be a floating dtype such as jnp.bfloat16. "
                f"Got {dtype}."
            )
        check_checkpoint(cls, checkpoint)

        tkey, pkey, bkey, hkey = jr.split(key, 4)
        self.token_embedding = eqx.nn.Embedding(vocab_size, d_model, key=tkey)
        self.position_embedding = eqx.nn.Embedding(max_len, d_model, key=pkey)
        self.embedding_dropout = eqx.nn.Dropout(float(dropout))
        self.blocks = eqx_remat.stack(
            lambda k: _Block(d_model, num_heads, d_ff, float(dropout), key=k),
            jr.split(bkey, num_layers),
        )
        self.final_norm = eqx.nn.LayerNorm(d_model)
        self.head = eqx.nn.Linear(d_model, vocab_size, use_bias=False, key=hkey)
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.d_ff = d_ff
        self.dropout = float(dropout)
        self.dtype = dtype
        self.checkpoint = checkpoint

    @jax.named_scope("zoo.Transformer")
    @jaxtyped(typechecker=beartype)
    def __call__(
        self, tokens: Int[Array, " seq"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq vocab"]:
        """**Arguments:**

        - `tokens`: one sequence of token ids, shape `(seq,)` with
          `1 <= seq <= max_len`, ids in `[0, vocab_size)`. Batch with `jax.vmap`
          (and one key per example).
        - `key`: a `jax.random` key for dropout; required when `dropout > 0`
          (unless in `equinox.nn.inference_mode`), ignored otherwise. (Keyword
          only.)

        **Returns:**

        The next-token logits, float32, shape `(seq, vocab_size)`: row `i` depends
        only on `tokens[: i + 1]`.
        """
        seq = tokens.shape[0]
        if not 1 <= seq <= self.max_len:
            raise ValueError(
                f"Transformer expected tokens of length 1 to max_len={self.max_len}. "
                f"Got tokens of shape {tokens.shape}."
            )
        training = self.dropout > 0 and not self.embedding_dropout.inference
        if training and key is None:
            raise ValueError(
                f"Transformer has dropout={self.dropout}: pass key=... to __call__, "
                "or turn dropout off with equinox.nn.inference_mode(model)."
            )
        x = self.token_embedding.weight[tokens] + self.position_embedding.weight[:seq]
        x = x.astype(self.dtype)
        layer_keys = None
        if training:
            ekey, lkey = jr.split(key)
            x = self.embedding_dropout(x, key=ekey)
            layer_keys = jr.split(lkey, self.num_layers)
        x = eqx_remat.scan_layers(
            self.blocks, x, layer_keys, checkpoint=self.checkpoint
        )
        x = jax.vmap(self.final_norm)(x)
        return _dense(self.head, x).astype(jnp.float32)

"""The decoder-only Transformer: its block, the model and its `llama` constructor."""

from collections.abc import Callable
from typing import Any, ClassVar, Literal, SupportsFloat, SupportsIndex

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from beartype import beartype
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, PRNGKeyArray, jaxtyped

import eqx_remat
from eqx_remat.internal import check_int

from ._attention import Attention, attend
from ._base import AbstractModel, as_unroll, check_choice
from ._layers import (
    Dense,
    Norm,
    _apply_norm,
    _dense_in,
    _matmul_t,
    _norm,
    _rope,
    gelu,
    wide,
)
from ._loss import cross_entropy
from ._sharding import _check_tensor, _embed, _gathered, _split_features


# The position encodings: a learned embedding, or rotary embeddings of q and k.
Position = Literal["learned", "rope"]
# The MLPs: `d_model -> d_ff -> d_model` with tanh-GELU, or SwiGLU.
Mlp = Literal["gelu", "swiglu"]


class _Block(eqx.Module):
    """One pre-norm decoder block: causal self-attention, then an MLP."""

    attention_norm: eqx.nn.LayerNorm | eqx.nn.RMSNorm
    qkv: Dense
    out: Dense
    mlp_norm: eqx.nn.LayerNorm | eqx.nn.RMSNorm
    mlp_gate: Dense | None
    mlp_in: Dense
    mlp_out: Dense
    dropout: eqx.nn.Dropout
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    attention: Attention = eqx.field(static=True)
    position: Position = eqx.field(static=True)
    mlp: Mlp = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        d_ff: int,
        dropout: float,
        attention: Attention,
        norm: Norm,
        position: Position,
        mlp: Mlp,
        use_bias: bool,
        *,
        key: PRNGKeyArray,
    ):
        qkey, okey, ikey, mkey, gkey = jr.split(key, 5)
        qkv_size = (num_heads + 2 * num_kv_heads) * head_dim
        self.attention_norm = _norm(norm, d_model)
        self.qkv = Dense(
            d_model, qkv_size, use_bias=use_bias, parallel="columns", key=qkey
        )
        self.out = Dense(
            num_heads * head_dim, d_model, use_bias=use_bias, parallel="rows", key=okey
        )
        self.mlp_norm = _norm(norm, d_model)
        self.mlp_gate = (
            Dense(d_model, d_ff, use_bias=use_bias, parallel="columns", key=gkey)
            if mlp == "swiglu"
            else None
        )
        self.mlp_in = Dense(
            d_model, d_ff, use_bias=use_bias, parallel="columns", key=ikey
        )
        self.mlp_out = Dense(
            d_ff, d_model, use_bias=use_bias, parallel="rows", key=mkey
        )
        self.dropout = eqx.nn.Dropout(dropout)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.attention = attention
        self.position = position
        self.mlp = mlp

    def __call__(self, x: Array, key: Array | None = None) -> Array:
        # On a mesh: this layer's weights whole (FSDP gathers one layer at a time),
        # the matrices in the compute dtype.
        seq = x.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        d_ff = self.mlp_in.weight.shape[-1]
        _check_tensor(self.qkv.weight, num_kv_heads=kv_heads, d_ff=d_ff)
        x = _split_features(x, self.qkv.weight)
        self = _gathered(_dense_in(self, x.dtype))
        akey, mkey = (None, None) if key is None else jr.split(key)
        x = checkpoint_name(x, "layer_input")

        # Causal multi-head (or grouped-query) self-attention.
        with jax.named_scope("attention"):
            h = _apply_norm(self.attention_norm, x)
            qkv = checkpoint_name(self.qkv(h), "qkv_proj")
            # Per key/value head: its group of query heads, its key, its value.
            group = heads // kv_heads
            qkv = qkv.reshape(seq, kv_heads, group + 2, head_dim)
            q = qkv[:, :, :group].reshape(seq, heads, head_dim)
            k, v = qkv[:, :, group], qkv[:, :, group + 1]
            if self.position == "rope":
                q, k = _rope(q), _rope(k)
            context = attend(self.attention, q, k, v).reshape(seq, heads * head_dim)
            context = checkpoint_name(context, "attention_context")
            a = checkpoint_name(self.out(context), "out_proj")
            x = _split_features(x + self.dropout(a, key=akey), self.qkv.weight)

        with jax.named_scope("mlp"):
            h = _apply_norm(self.mlp_norm, x)
            up = checkpoint_name(self.mlp_in(h), "mlp_hidden")
            if self.mlp_gate is None:
                hidden = gelu(up)
            else:
                gate = checkpoint_name(self.mlp_gate(h), "mlp_gate")
                hidden = jax.nn.silu(gate) * up
            m = checkpoint_name(self.mlp_out(hidden), "mlp_out")
            x = x + self.dropout(m, key=mkey)
        return _split_features(x, self.qkv.weight)


class Transformer(AbstractModel):
    """A decoder-only causal language model, its blocks stacked and scanned with
    [`eqx_remat.scan_layers`][] and checkpointed by `checkpoint`.

    By default it is GPT-2's: learned position embeddings, `LayerNorm`, multi-head
    attention, a GELU MLP, biases. Keyword arguments switch each part to its
    modern (Llama) counterpart, and [`zoo.Transformer.llama`][] builds that block
    in one line:

    - `attention`: `"xla"` (scores written out, `(heads, seq, seq)`),
      `"dot_product"` (`jax.nn.dot_product_attention`) or `"flash"` (the Pallas
      TPU flash kernel);
    - `norm`: `"layer"` (`LayerNorm`, weight and bias) or `"rms"` (`RMSNorm`,
      weight only);
    - `position`: `"learned"` (a position embedding) or `"rope"` (rotary
      embedding of the queries and keys);
    - `mlp`: `"gelu"` (`d_model -> d_ff -> d_model`, tanh-GELU) or `"swiglu"`
      (`(silu(h W_gate) * h W_in) W_out`);
    - `num_kv_heads`: `num_heads`, or fewer for grouped-query attention;
    - `tie_embeddings`: `False` (a separate output head) or `True` (logits are
      `x @ token_embedding.T`);
    - `use_bias`: `True`, or `False` for no bias in any linear layer.

    - Pre-norm blocks `x + attention(norm(x))`, `x + mlp(norm(x))`, then a final
      norm and the output head (no bias). Norms, the attention softmax and rotary
      embeddings are computed in at least float32 (float64 for a float64
      model).
    - The queries, keys and values come from one fused `qkv` projection, of size
      `(num_heads + 2 num_kv_heads) head_dim`, laid out by key/value head: for
      each, its group of `num_heads / num_kv_heads` query heads, then its key,
      then its value. Split into equal parts by column, each part holds whole
      heads: what tensor parallelism splits (see [`zoo.shard`][]).
    - Dropout (`dropout > 0`) is applied to the embeddings and to the output of
      each attention and MLP branch (not to the attention weights). The `key` of
      `__call__` is split into one key per layer, passed to the scan as per-layer
      inputs: every checkpointing schedule regenerates the same masks when it
      recomputes a layer, and masks are recomputed rather than saved.
      `equinox.nn.inference_mode(model)` turns dropout off.
    - Projection weights are stored `(in, out)`, as Flax's `Dense` stores them
      (not `equinox.nn.Linear`'s `(out, in)`: on TPU that layout costs a copy of
      each recomputed layer input, see [`zoo.Dense`][]), and the tied head contracts
      with the embedding's model axis directly: no transposed copy of a weight is
      made, so none is saved for the backward pass.

    **Attention implementations.** `"xla"` and `"dot_product"` store the
    `(heads, seq, seq)` attention weights for the backward pass (checkpointing
    policies may drop them: `"dots"` keeps the scores, they are a matrix
    product). `"flash"` runs `jax.experimental.pallas.ops.tpu.flash_attention`,
    which never writes the scores out: it saves its inputs, output and per-row
    softmax statistics, and recomputes the scores in its backward kernels.
    It needs a TPU (or Pallas' TPU interpret mode,
    `jax.experimental.pallas.tpu.force_tpu_interpret_mode()`, for tests on the
    CPU); elsewhere calling the model raises a `ValueError` naming the
    alternatives. Sequences are padded to a multiple of 128 inside the kernel.
    When the tokens are sharded over a mesh (Auto or Explicit axes, or a mesh set
    with `jax.set_mesh`), the kernel runs under `jax.shard_map` over that mesh, as
    XLA requires; batch with `jax.vmap(model, spmd_axis_name="data")` (the mesh
    axis the batch is split over) so that each chip runs attention for its own
    examples — a plain `jax.vmap` gives every chip the whole batch's attention.

    **Tags.** Intermediates are tagged with `jax.ad_checkpoint.checkpoint_name`,
    so that name-based policies ([`eqx_remat.save_names`][],
    [`eqx_remat.offload_names`][], ...) select them. `model.activation_names`
    lists those of a model; `Transformer.ACTIVATION_NAMES` those of the default
    model. Per example:

    | name | value | shape |
    |---|---|---|
    | `layer_input` | a block's input | `(seq, d_model)` |
    | `qkv_proj` | the fused q/k/v projection (before rope) | `(seq, (h + 2 kv) hd)` |
    | `attention_context` | attention output, heads merged | `(seq, h hd)` |
    | `out_proj` | the attention output projection | `(seq, d_model)` |
    | `mlp_hidden` | GELU: the pre-activation; SwiGLU: `h W_in` | `(seq, d_ff)` |
    | `mlp_gate` | SwiGLU only: `h W_gate`, before `silu` | `(seq, d_ff)` |
    | `mlp_out` | the MLP's output projection | `(seq, d_model)` |

    (`h` heads, `kv` key/value heads, `hd` head dimension.) Every tag exists for
    every option but `mlp_gate`, which exists only with `mlp="swiglu"`.
    The output head has no tag and sits outside the checkpointed stack: with
    `loss_chunk_size`, [`zoo.Transformer.loss`][] recomputes each chunk's
    logits whatever `checkpoint` says, and the tags above, and the policies
    that name them, are the same with or without it.
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
    position_embedding: eqx.nn.Embedding | None
    embedding_dropout: eqx.nn.Dropout
    blocks: _Block
    final_norm: eqx.nn.LayerNorm | eqx.nn.RMSNorm
    head: Dense | None
    vocab_size: int = eqx.field(static=True)
    max_len: int = eqx.field(static=True)
    d_model: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)
    d_ff: int = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    dtype: np.dtype = eqx.field(static=True)
    attention: Attention = eqx.field(static=True)
    norm: Norm = eqx.field(static=True)
    position: Position = eqx.field(static=True)
    mlp: Mlp = eqx.field(static=True)
    tie_embeddings: bool = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    loss_chunk_size: int | None = eqx.field(static=True)
    checkpoint: eqx_remat.Checkpoint = eqx.field(static=True)
    unroll: int | bool = eqx.field(static=True, converter=as_unroll)

    def __init__(
        self,
        vocab_size: SupportsIndex,
        max_len: SupportsIndex,
        d_model: SupportsIndex,
        num_heads: SupportsIndex,
        num_layers: SupportsIndex,
        *,
        d_ff: SupportsIndex | None = None,
        dropout: SupportsFloat = 0.0,
        dtype: Any = None,
        attention: Attention = "xla",
        norm: Norm = "layer",
        position: Position = "learned",
        mlp: Mlp = "gelu",
        num_kv_heads: SupportsIndex | None = None,
        head_dim: SupportsIndex | None = None,
        tie_embeddings: bool = False,
        use_bias: bool = True,
        loss_chunk_size: SupportsIndex | None = None,
        checkpoint: eqx_remat.Checkpoint = None,
        unroll: SupportsIndex | bool = 1,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `vocab_size`: the number of token ids; tokens are ints in
          `[0, vocab_size)`.
        - `max_len`: the longest sequence the model accepts (the size of the
          learned position embedding).
        - `d_model`: the width of the residual stream.
        - `num_heads`: the number of attention (query) heads; must divide
          `d_model` unless `head_dim` is given.
        - `num_layers`: the number of decoder blocks (stacked and scanned); >= 1.
        - `d_ff`: the hidden size of each block's MLP. Default `4 * d_model`.
        - `dropout`: the dropout rate, in `[0, 1)`. Default `0.0` (no dropout).
        - `dtype`: the compute dtype of the activations and matrix multiplies,
          e.g. `jnp.bfloat16`. Parameters are in JAX's default float type (and
          are cast inside each layer); norms, attention softmax and the returned
          logits are in at least float32. Default `None`: JAX's default float
          type throughout (float32, or float64 under `jax_enable_x64`), as in
          Equinox.
        - `attention`: `"xla"` (default), `"dot_product"` or `"flash"` (see
          above).
        - `norm`: `"layer"` (default, `LayerNorm`) or `"rms"` (`RMSNorm`).
        - `position`: `"learned"` (default) or `"rope"` (rotary; needs an even
          head dimension, `head_dim`).
        - `mlp`: `"gelu"` (default) or `"swiglu"`.
        - `num_kv_heads`: the number of key/value heads; must divide `num_heads`.
          Default `num_heads` (multi-head attention); fewer is grouped-query
          attention, 1 multi-query attention.
        - `head_dim`: the width of each attention head. Default
          `d_model // num_heads`; another value makes the attention
          `num_heads * head_dim` wide, as many models are (MaxText's, Gemma's):
          the q/k/v projection maps `d_model` to `(num_heads + 2 num_kv_heads)
          head_dim` and the output projection `num_heads * head_dim` back to
          `d_model`.
        - `tie_embeddings`: if `True`, the output head is the transpose of the
          token embedding (no separate head). Default `False`.
        - `use_bias`: whether the linear layers have biases. Default `True`.
        - `loss_chunk_size`: how [`zoo.Transformer.loss`][] computes the
          cross-entropy: `None` (default) from the whole logits, `(seq, vocab)`
          per sequence; an int >= 1, over chunks of that many positions whose
          logits are recomputed in the backward pass, so that the whole logits
          never exist (see [`zoo.cross_entropy`][]). `__call__`, which returns
          the logits, is unchanged. [`zoo.set_loss_chunk_size`][] switches it on
          a model already built.
        - `checkpoint`: how the stack of blocks is checkpointed: `None`, a policy
          or its name, or a schedule (see [`eqx_remat.scan_layers`][]).
        - `unroll`: layers per iteration of the layer loop (`lax.scan`'s
          `unroll`, see [`eqx_remat.scan_layers`][]): an int >= 1, or `True` for
          the whole stack. Changes compile and step time, never the result.
        - `key`: a `jax.random` key for the initialisation. (Keyword only.)

        Integer arguments take any integer type (`int`, `numpy.int64`, a concrete
        JAX integer) and are stored as Python `int`s.
        """
        cls = "Transformer"
        vocab_size = check_int(cls, "vocab_size", vocab_size, 1)
        max_len = check_int(cls, "max_len", max_len, 1)
        d_model = check_int(cls, "d_model", d_model, 1)
        num_heads = check_int(cls, "num_heads", num_heads, 1)
        num_layers = check_int(cls, "num_layers", num_layers, 1)
        d_ff = 4 * d_model if d_ff is None else check_int(cls, "d_ff", d_ff, 1)
        _check_options(cls, attention, norm, position, mlp, tie_embeddings, use_bias)
        num_kv_heads, head_dim = _check_heads(
            cls, d_model, num_heads, num_kv_heads, head_dim, position
        )
        dropout = _check_dropout(cls, dropout)
        dtype = _check_dtype(cls, dtype)
        if loss_chunk_size is not None:
            loss_chunk_size = check_int(cls, "loss_chunk_size", loss_chunk_size, 1)

        tkey, pkey, bkey, hkey = jr.split(key, 4)
        self.token_embedding = eqx.nn.Embedding(vocab_size, d_model, key=tkey)
        self.position_embedding = (
            eqx.nn.Embedding(max_len, d_model, key=pkey)
            if position == "learned"
            else None
        )
        self.embedding_dropout = eqx.nn.Dropout(dropout)
        block = (d_model, num_heads, num_kv_heads, head_dim, d_ff, dropout)
        block += (attention, norm)
        block += (position, mlp, use_bias)
        self.blocks = eqx_remat.stack(
            lambda k: _Block(*block, key=k), jr.split(bkey, num_layers)
        )
        self.final_norm = _norm(norm, d_model)
        self.head = (
            None
            if tie_embeddings
            else Dense(
                d_model, vocab_size, use_bias=False, parallel="columns", key=hkey
            )
        )
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_layers = num_layers
        self.d_ff = d_ff
        self.dropout = dropout
        self.dtype = dtype
        self.attention = attention
        self.norm = norm
        self.position = position
        self.mlp = mlp
        self.tie_embeddings = tie_embeddings
        self.use_bias = use_bias
        self.loss_chunk_size = loss_chunk_size
        self.checkpoint = checkpoint
        # Stored as an int by the field's converter, which pyright does not model.
        self.unroll = unroll  # pyright: ignore[reportAttributeAccessIssue]

    @classmethod
    def llama(
        cls,
        vocab_size: SupportsIndex,
        max_len: SupportsIndex,
        d_model: SupportsIndex,
        num_heads: SupportsIndex,
        num_layers: SupportsIndex,
        *,
        num_kv_heads: SupportsIndex | None = None,
        d_ff: SupportsIndex | None = None,
        attention: Attention = "dot_product",
        **kwargs: Any,
    ) -> "Transformer":
        """The modern (Llama-style) decoder in one line: `RMSNorm`, rotary position
        embeddings, a SwiGLU MLP, grouped-query attention, no biases, an untied
        output head.

        ```python
        model = zoo.Transformer.llama(32000, 2048, 2048, 16, 24, num_kv_heads=8,
                                      attention="flash", dtype=jnp.bfloat16,
                                      checkpoint="dots", key=key)
        ```

        is `zoo.Transformer(..., norm="rms", position="rope", mlp="swiglu",
        num_kv_heads=..., use_bias=False, ...)`.

        **Arguments:**

        As for [`zoo.Transformer`][], with these defaults:

        - `num_kv_heads`: `max(1, num_heads // 4)` when that divides `num_heads`
          (Llama-3-style grouping), else `num_heads`.
        - `d_ff`: `8/3 d_model` (SwiGLU's three matrices cost what GELU's two
          cost at `4 d_model`), rounded up to a multiple of 256 (of 8 when
          `d_model < 256`).
        - `attention`: `"dot_product"` (use `"flash"` on TPU).
        - `**kwargs`: any other keyword argument of [`zoo.Transformer`][]
          (`dtype`, `dropout`, `checkpoint`, `tie_embeddings`, `key`, ...).

        **Returns:**

        A [`zoo.Transformer`][].
        """
        d_model = check_int("Transformer.llama", "d_model", d_model, 1)
        num_heads = check_int("Transformer.llama", "num_heads", num_heads, 1)
        if num_kv_heads is None:
            groups = max(1, num_heads // 4)
            num_kv_heads = groups if num_heads % groups == 0 else num_heads
        if d_ff is None:
            multiple = 256 if d_model >= 256 else 8
            d_ff = -(-(8 * d_model // 3) // multiple) * multiple
        kwargs = {"norm": "rms", "position": "rope", "mlp": "swiglu", **kwargs}
        kwargs.setdefault("use_bias", False)
        return cls(
            vocab_size,
            max_len,
            d_model,
            num_heads,
            num_layers,
            num_kv_heads=num_kv_heads,
            d_ff=d_ff,
            attention=attention,
            **kwargs,
        )

    @property
    def activation_names(self) -> tuple[str, ...]:
        """The `checkpoint_name` tags in this model's blocks (see the table
        above)."""
        names = list(self.ACTIVATION_NAMES)
        if self.mlp == "swiglu":
            names.insert(names.index("mlp_out"), "mlp_gate")
        return tuple(names)

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

        The next-token logits, float32 (float64 for a float64 model), shape
        `(seq, vocab_size)`: row `i` depends
        only on `tokens[: i + 1]`.
        """
        features, head = self._features(tokens, key)
        return head(features).astype(wide(self.dtype))

    @jax.named_scope("zoo.Transformer.loss")
    @jaxtyped(typechecker=beartype)
    def loss(
        self,
        tokens: Int[Array, " seq"],
        targets: Int[Array, " seq"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " seq"]:
        """The cross-entropy of the model's predictions for `tokens` against
        `targets`, position by position: `-log softmax(model(tokens))[targets]`,
        computed as `loss_chunk_size` says (see [`zoo.cross_entropy`][]): with
        an int, the whole `(seq, vocab)` logits never exist, in the forward pass
        or the backward pass.

        ```python
        def loss_fn(model, tokens):  # tokens: (batch, seq + 1)
            losses = jax.vmap(model.loss)(tokens[:, :-1], tokens[:, 1:])
            return losses.mean()
        ```

        **Arguments:**

        - `tokens`: one sequence of token ids, as for `__call__`.
        - `targets`: the token id to predict at each position, shape `(seq,)`,
          ids in `[0, vocab_size)` (for next-token prediction, the tokens shifted
          by one).
        - `key`: a `jax.random` key for dropout, as for `__call__`. (Keyword
          only.)

        **Returns:**

        The loss of each position, float32 (float64 for a float64 model), shape
        `(seq,)`; take the mean for the usual loss.
        """
        features, head = self._features(tokens, key)
        return cross_entropy(head, features, targets, chunk_size=self.loss_chunk_size)

    def _features(
        self, tokens: Array, key: PRNGKeyArray | None
    ) -> tuple[Array, Callable[[Array], Array]]:
        """The final norm's output `(seq, d_model)` and the output head (a
        function of rows), the weights gathered on a mesh."""
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
        # On a mesh, the weights outside the scan are gathered whole.
        token_embedding, position_embedding, final_norm, head = _gathered(
            _dense_in(
                (
                    self.token_embedding,
                    self.position_embedding,
                    self.final_norm,
                    self.head,
                ),
                self.dtype,
            )
        )
        x = _embed(token_embedding.weight, tokens)
        if position_embedding is not None:
            x = x + position_embedding.weight[:seq]
        x = x.astype(self.dtype)
        layer_keys = None
        if training and key is not None:  # (`key is None` raised above)
            ekey, lkey = jr.split(key)
            x = self.embedding_dropout(x, key=ekey)
            layer_keys = jr.split(lkey, self.num_layers)
        x = eqx_remat.scan_layers(
            self.blocks, x, layer_keys, checkpoint=self.checkpoint, unroll=self.unroll
        )
        x = _apply_norm(final_norm, x)
        if head is None:
            weight = token_embedding.weight
            return x, lambda h: _matmul_t(h, weight)
        return x, head


def _check_options(
    cls: str,
    attention: Any,
    norm: Any,
    position: Any,
    mlp: Any,
    tie_embeddings: Any,
    use_bias: Any,
) -> None:
    """Raise a `ValueError` naming `cls` unless each option is one of its `Literal`
    type's choices and each flag is a `bool`."""
    for name, value, choices in (
        ("attention", attention, Attention),
        ("norm", norm, Norm),
        ("position", position, Position),
        ("mlp", mlp, Mlp),
    ):
        check_choice(cls, name, value, choices)
    for name, value in (("tie_embeddings", tie_embeddings), ("use_bias", use_bias)):
        if not isinstance(value, bool):
            raise ValueError(f"{cls}: {name} must be a bool. Got {value!r}.")


def _check_heads(
    cls: str,
    d_model: int,
    num_heads: int,
    num_kv_heads: Any,
    head_dim: Any,
    position: Position,
) -> tuple[int, int]:
    """`(num_kv_heads, head_dim)` as `int`s (`None`: `num_heads`, and
    `d_model // num_heads`, which must then divide), once the heads are checked
    to divide each other and the head dimension to be even under rotary
    embeddings."""
    if head_dim is not None:
        head_dim = check_int(cls, "head_dim", head_dim, 1)
    elif d_model % num_heads != 0:
        raise ValueError(
            f"{cls}: d_model must be divisible by num_heads. "
            f"Got d_model={d_model}, num_heads={num_heads} (or give head_dim)."
        )
    given = head_dim is not None
    head_dim = head_dim if given else d_model // num_heads
    if num_kv_heads is None:
        num_kv_heads = num_heads
    num_kv_heads = check_int(cls, "num_kv_heads", num_kv_heads, 1)
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{cls}: num_heads must be divisible by num_kv_heads. "
            f"Got num_heads={num_heads}, num_kv_heads={num_kv_heads}."
        )
    if position == "rope" and head_dim % 2 != 0:
        got = f"head_dim={head_dim}"
        if not given:
            got = f"{d_model} // {num_heads} = {head_dim} (d_model // num_heads)"
        raise ValueError(
            f"{cls}: position='rope' needs an even head dimension. Got {got}."
        )
    return num_kv_heads, head_dim


def _check_dropout(cls: str, dropout: Any) -> float:
    # A real number: Python's, NumPy's or a concrete JAX scalar.
    real = np.ndim(dropout) == 0 and np.isrealobj(dropout)
    if isinstance(dropout, (bool, str, bytes)) or not real or not 0 <= dropout < 1:
        raise ValueError(f"{cls}: dropout must be in [0, 1). Got {dropout!r}.")
    return float(dropout)


def _check_dtype(cls: str, dtype: Any) -> np.dtype:
    """`dtype` as a floating `np.dtype` (`None`: JAX's default float type, float64
    under `jax_enable_x64`, as Equinox's layers take it)."""
    if dtype is None:
        return jnp.dtype(jax.dtypes.canonicalize_dtype(float))
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(
            f"{cls}: dtype must be a floating dtype such as jnp.bfloat16. "
            f"Got {dtype!r}."
        ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{cls}: dtype must be a floating dtype such as jnp.bfloat16. Got {dtype}."
        )
    return dtype

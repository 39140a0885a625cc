import math
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from beartype import beartype
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray, jaxtyped

import eqx_remat
import eqx_remat.internal

from ._util import check_checkpoint, check_int, check_unroll


ATTENTIONS = ("xla", "dot_product", "flash")
NORMS = ("layer", "rms")
POSITIONS = ("learned", "rope")
MLPS = ("gelu", "swiglu")
# Rotary position embedding: the base of its frequencies (Llama's).
ROPE_BASE = 10000.0
# The Pallas flash kernel's tiles are 128 long: sequences are padded to a multiple.
FLASH_BLOCK = 128


class Dense(eqx.Module):
    """A linear layer `x @ weight + bias` whose weight is stored `(in, out)`, as
    Flax's `Dense` and MaxText store it: the Transformer's projections.

    Why not `equinox.nn.Linear`, whose weight is `(out, in)`: with that layout the
    TPU compiler lays the activations out for the forward product differently
    from the weight gradient's, and under checkpointing it keeps a re-laid-out
    copy of each recomputed layer input (TPU v5e, compiled ahead of time: +1.2%
    temp memory under `"nothing"` on the `transformer-v5e` benchmark preset,
    against the same model with `(in, out)` weights; with those, and the norms
    of `_apply_norm`, the temp bytes are Flax linen's to the byte).

    The parameters stay in their own dtype (float32) and are cast inside the
    product to the input's dtype, so a low-precision compute dtype never
    materialises a second copy of a whole stack's weights.
    """

    weight: Float[Array, "*layers in out"]
    bias: Float[Array, "*layers out"] | None

    def __init__(self, in_size: int, out_size: int, *, use_bias: bool = True, key):
        """**Arguments:**

        - `in_size`: the size of the input's last axis; an int >= 1.
        - `out_size`: the size of the output's last axis; an int >= 1.
        - `use_bias`: whether to add a bias. (Keyword only.)
        - `key`: a `jax.random` key for the initialisation, uniform in
          `±1/sqrt(in_size)` as `equinox.nn.Linear`'s. (Keyword only.)
        """
        in_size = check_int("Dense", "in_size", in_size, 1)
        out_size = check_int("Dense", "out_size", out_size, 1)
        wkey, bkey = jr.split(key)
        lim = 1 / math.sqrt(in_size)
        self.weight = jr.uniform(wkey, (in_size, out_size), minval=-lim, maxval=lim)
        self.bias = (
            jr.uniform(bkey, (out_size,), minval=-lim, maxval=lim) if use_bias else None
        )

    def __call__(self, x: Float[Array, "*rows in"]) -> Float[Array, "*rows out"]:
        """**Arguments:**

        - `x`: an array whose last axis has size `in_size`, in the compute dtype.

        **Returns:**

        `x @ weight + bias`, in `x`'s dtype, the last axis of size `out_size`.
        """
        if x.shape[-1:] != self.weight.shape[-2:-1]:
            raise ValueError(
                f"Dense expected x with last axis {self.weight.shape[-2]}. "
                f"Got shape {x.shape}."
            )
        y = x @ self.weight.astype(x.dtype)
        if self.bias is not None:
            y = y + self.bias.astype(x.dtype).reshape((1,) * (y.ndim - 1) + (-1,))
        return y


def _matmul_t(x: Array, weight: Array) -> Array:
    """`x @ weight.T` for a `(out, in)` weight (the tied embedding), contracting
    the input axis directly: a transposed weight would be a new array, and the
    backward pass would save it as a residual."""
    return lax.dot_general(x, weight.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())))


def _norm(kind: str, d_model: int) -> eqx.nn.LayerNorm | eqx.nn.RMSNorm:
    if kind == "layer":
        return eqx.nn.LayerNorm(d_model)
    # Llama's RMSNorm: a weight, no bias.
    return eqx.nn.RMSNorm(d_model, use_bias=False)


def _apply_norm(norm: eqx.nn.LayerNorm | eqx.nn.RMSNorm, x: Array) -> Array:
    """`norm` applied to each row of `x`, in float32, returned in `x.dtype`.

    Computed as Flax does, the weight folded into the per-row scale first
    (`(x - mean) * (rsqrt(var + eps) * weight) + bias`): the backward pass then
    keeps `x - mean` and a per-row scale, not a normalised copy of `x` as well
    (measured: one `(batch, seq, d_model)` buffer less than `jax.vmap(norm)`).
    The statistics are written as Flax's `LayerNorm(use_fast_variance=False)`
    writes them (reduce, then `expand_dims`; `x - mean` written twice, once for
    the variance and once for the output): written with `keepdims=True`, or with
    one shared `x - mean`, the TPU compiler fuses the backward pass differently
    and keeps one more per-row buffer (+32 KiB on the v5e benchmark preset under
    `"nothing"`). `count_flops` counts both subtractions.
    """
    x32 = x.astype(jnp.float32)
    row = (1,) * (x.ndim - 1) + (-1,)
    weight = norm.weight.astype(jnp.float32).reshape(row)
    if isinstance(norm, eqx.nn.LayerNorm):
        mean = jnp.expand_dims(jnp.mean(x32, axis=-1), -1)
        var = jnp.expand_dims(jnp.mean(lax.square(x32 - mean), axis=-1), -1)
        out = (x32 - mean) * (lax.rsqrt(var + norm.eps) * weight)
    else:
        ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        out = x32 * (lax.rsqrt(ms + norm.eps) * weight)
    if norm.bias is not None:
        out = out + norm.bias.astype(jnp.float32).reshape(row)
    return out.astype(x.dtype)


def _rope(x: Array) -> Array:
    """Rotary position embedding of `x`, `(seq, heads, head_dim)`, positions
    `0 … seq - 1`, rotating the two halves of each head (Llama's convention), in
    float32."""
    seq, _, head_dim = x.shape
    half = head_dim // 2
    inv_freq = ROPE_BASE ** (-jnp.arange(half, dtype=jnp.float32) * 2 / head_dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _xla_attention(q: Array, k: Array, v: Array) -> Array:
    """Causal attention written out: `q` `(seq, heads, hd)`, `k`, `v` `(seq,
    kv_heads, hd)`. Scores and softmax in float32; stores `(heads, seq, seq)`."""
    seq, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    if kv_heads == heads:
        scores = jnp.einsum("qhd,khd->hqk", q, k).astype(jnp.float32)
    else:
        qg = q.reshape(seq, kv_heads, heads // kv_heads, head_dim)
        scores = jnp.einsum("qngd,knd->ngqk", qg, k).astype(jnp.float32)
    scores = scores / math.sqrt(head_dim)
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    if kv_heads == heads:
        return jnp.einsum("hqk,khd->qhd", weights, v)
    context = jnp.einsum("ngqk,knd->qngd", weights, v)
    return context.reshape(seq, heads, head_dim)


def _dot_product_attention(q: Array, k: Array, v: Array) -> Array:
    """`jax.nn.dot_product_attention` (grouped-query attention natively)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _flash_module():
    try:
        from jax.experimental.pallas.ops.tpu import flash_attention
    except ImportError as e:  # pragma: no cover - shipped with jax
        raise ImportError(
            "zoo.Transformer(attention='flash') needs "
            "jax.experimental.pallas.ops.tpu.flash_attention, which this jax does "
            "not have. Use attention='dot_product' or attention='xla'."
        ) from e
    return flash_attention


def _mesh_of(x: Array) -> Any:
    """The (abstract) mesh `x` is sharded on: from its type, else the mesh set with
    `jax.set_mesh`; `None` if neither has axes."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not mesh.axis_names:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or not mesh.axis_names or math.prod(mesh.axis_sizes) == 1:
        return None
    return mesh


def _platform(mesh: Any) -> str:
    if mesh is not None:
        platform = getattr(getattr(mesh, "abstract_device", None), "platform", None)
        if platform is not None:
            return platform
    return jax.default_backend()


def _interpreting() -> bool:
    """Whether Pallas TPU kernels run in interpret mode
    (`jax.experimental.pallas.tpu.force_tpu_interpret_mode()`)."""
    try:
        from jax._src import config

        return config.pallas_tpu_interpret_mode_context_manager.value is not None
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions
        return False


def _flash_attention(q: Array, k: Array, v: Array) -> Array:
    """Causal attention with the Pallas TPU flash kernel: nothing `(seq, seq)`
    leaves the kernel (it keeps per-row softmax statistics for the backward pass).

    One example: `q` `(seq, heads, hd)`, `k`, `v` `(seq, kv_heads, hd)`. The
    kernel wants equal head counts, so grouped keys and values are repeated, and
    tiles of 128, so the sequence is padded at its end (causal attention never
    looks at later positions: the padding changes no real row). On a mesh the
    kernel runs under `jax.shard_map` (XLA cannot partition a Mosaic kernel): each
    device runs it on the examples it holds.
    """
    fa = _flash_module()
    seq, heads, head_dim = q.shape
    mesh = _mesh_of(q)
    platform = _platform(mesh)
    if platform != "tpu" and not _interpreting():
        raise ValueError(
            "zoo.Transformer(attention='flash') runs the Pallas TPU flash-attention "
            f"kernel, which needs a TPU; this program is for {platform!r}. Use "
            "attention='dot_product' (jax.nn.dot_product_attention: cuDNN on GPU) or "
            "attention='xla', or run under "
            "jax.experimental.pallas.tpu.force_tpu_interpret_mode() (slow, for "
            "tests)."
        )
    group = heads // k.shape[1]
    if group > 1:
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    pad = -seq % FLASH_BLOCK

    def to_kernel(x):  # (seq, heads, hd) -> (1, heads, seq + pad, hd)
        x = jnp.pad(x, ((0, pad), (0, 0), (0, 0)))
        return jnp.transpose(x, (1, 0, 2))[None]

    length = seq + pad
    blocks = fa.BlockSizes.get_default(1, heads, length, length, head_dim)

    def kernel(q, k, v):
        return _flash_with_costs(fa, q, k, v, 1 / math.sqrt(head_dim), blocks)

    if mesh is not None:
        # Per example, replicated: under `jax.vmap(..., spmd_axis_name=axis)` the
        # batch axis is split over the mesh axis `axis`.
        kernel = jax.shard_map(
            kernel,
            mesh=mesh,
            in_specs=PartitionSpec(),
            out_specs=PartitionSpec(),
            check_vma=False,
        )
    out = kernel(to_kernel(q), to_kernel(k), to_kernel(v))
    return jnp.transpose(out[0], (1, 0, 2))[:seq]


def _flash_with_costs(fa, q, k, v, sm_scale, blocks):
    """`flash_attention(q, k, v, causal=True)`, `(batch, heads, seq, hd)`, whose
    backward kernels carry a `pl.CostEstimate` (jax's forward kernel has one, its
    two backward kernels none), so that `eqx_remat.count_flops` counts them.

    The estimates follow the forward's convention (`pl.estimate_cost` of the
    reference attention: full, not causally halved, `(seq, seq)` products): the
    dK/dV kernel recomputes the scores and does three more products (4 in all),
    the dQ kernel recomputes them and does two more (3)."""

    def attend(q, k, v):
        return fa.flash_attention(
            q, k, v, causal=True, sm_scale=sm_scale, block_sizes=blocks
        )

    @jax.custom_vjp
    def flash(q, k, v):
        return attend(q, k, v)

    def fwd(q, k, v):
        return jax.vjp(attend, q, k, v)

    def bwd(vjp, g):
        from jax.experimental import pallas as pl

        batch, heads, length, head_dim = q.shape
        squares = batch * heads * length * length

        def cost(products):  # (seq, seq) products, and the softmax's
            return pl.CostEstimate(
                flops=products * 2 * squares * head_dim + 4 * squares,
                transcendentals=squares,
                bytes_accessed=0,
            )

        costs = {
            "_flash_attention_dkv_kernel": cost(4),  # dK, dV
            "_flash_attention_dq_kernel": cost(3),  # dQ
        }
        return eqx_remat.internal.with_pallas_costs(vjp, costs)(g)

    flash.defvjp(fwd, bwd)
    return flash(q, k, v)


_ATTENTION_FNS = {
    "xla": _xla_attention,
    "dot_product": _dot_product_attention,
    "flash": _flash_attention,
}


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
    attention: str = eqx.field(static=True)
    position: str = eqx.field(static=True)
    mlp: str = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        d_ff: int,
        dropout: float,
        attention: str,
        norm: str,
        position: str,
        mlp: str,
        use_bias: bool,
        *,
        key,
    ):
        qkey, okey, ikey, mkey, gkey = jr.split(key, 5)
        head_dim = d_model // num_heads
        qkv_size = (num_heads + 2 * num_kv_heads) * head_dim
        self.attention_norm = _norm(norm, d_model)
        self.qkv = Dense(d_model, qkv_size, use_bias=use_bias, key=qkey)
        self.out = Dense(d_model, d_model, use_bias=use_bias, key=okey)
        self.mlp_norm = _norm(norm, d_model)
        self.mlp_gate = (
            Dense(d_model, d_ff, use_bias=use_bias, key=gkey)
            if mlp == "swiglu"
            else None
        )
        self.mlp_in = Dense(d_model, d_ff, use_bias=use_bias, key=ikey)
        self.mlp_out = Dense(d_ff, d_model, use_bias=use_bias, key=mkey)
        self.dropout = eqx.nn.Dropout(dropout)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.attention = attention
        self.position = position
        self.mlp = mlp

    def __call__(self, x: Array, key: Array | None = None) -> Array:
        self = _gathered(self)  # on Explicit mesh axes: this layer's weights whole
        seq, d_model = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        head_dim = d_model // heads
        akey, mkey = (None, None) if key is None else jr.split(key)
        x = checkpoint_name(x, "layer_input")

        # Causal multi-head (or grouped-query) self-attention.
        with jax.named_scope("attention"):
            h = _apply_norm(self.attention_norm, x)
            qkv = checkpoint_name(self.qkv(h), "qkv_proj")
            if kv_heads == heads:
                q, k, v = jnp.split(qkv.reshape(seq, 3, heads, head_dim), 3, 1)
                q, k, v = q[:, 0], k[:, 0], v[:, 0]
            else:
                q_size, kv_size = heads * head_dim, kv_heads * head_dim
                q = qkv[:, :q_size].reshape(seq, heads, head_dim)
                k = qkv[:, q_size : q_size + kv_size].reshape(seq, kv_heads, head_dim)
                v = qkv[:, q_size + kv_size :].reshape(seq, kv_heads, head_dim)
            if self.position == "rope":
                q, k = _rope(q), _rope(k)
            context = _ATTENTION_FNS[self.attention](q, k, v).reshape(seq, d_model)
            context = checkpoint_name(context, "attention_context")
            a = checkpoint_name(self.out(context), "out_proj")
            x = x + self.dropout(a, key=akey)

        with jax.named_scope("mlp"):
            h = _apply_norm(self.mlp_norm, x)
            up = checkpoint_name(self.mlp_in(h), "mlp_hidden")
            if self.mlp_gate is None:
                hidden = jax.nn.gelu(up)
            else:
                gate = checkpoint_name(self.mlp_gate(h), "mlp_gate")
                hidden = jax.nn.silu(gate) * up
            m = checkpoint_name(self.mlp_out(hidden), "mlp_out")
            x = x + self.dropout(m, key=mkey)
        return x


def _check_choice(cls: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"{cls}: unknown {name} {value!r}. It needs to be one of {list(choices)}."
        )


class Transformer(eqx.Module):
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
      embeddings are computed in float32.
    - The queries, keys and values come from one fused `qkv` projection, of size
      `(num_heads + 2 num_kv_heads) head_dim`.
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
    | `attention_context` | attention output, heads merged | `(seq, d_model)` |
    | `out_proj` | the attention output projection | `(seq, d_model)` |
    | `mlp_hidden` | GELU: the pre-activation; SwiGLU: `h W_in` | `(seq, d_ff)` |
    | `mlp_gate` | SwiGLU only: `h W_gate`, before `silu` | `(seq, d_ff)` |
    | `mlp_out` | the MLP's output projection | `(seq, d_model)` |

    (`h` heads, `kv` key/value heads, `hd` head dimension.) Every tag exists for
    every option but `mlp_gate`, which exists only with `mlp="swiglu"`.
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
    num_layers: int = eqx.field(static=True)
    d_ff: int = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    dtype: np.dtype = eqx.field(static=True)
    attention: str = eqx.field(static=True)
    norm: str = eqx.field(static=True)
    position: str = eqx.field(static=True)
    mlp: str = eqx.field(static=True)
    tie_embeddings: bool = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    checkpoint: eqx_remat.Checkpoint = eqx.field(static=True)
    unroll: int | bool = eqx.field(static=True)

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
        attention: Literal["xla", "dot_product", "flash"] = "xla",
        norm: Literal["layer", "rms"] = "layer",
        position: Literal["learned", "rope"] = "learned",
        mlp: Literal["gelu", "swiglu"] = "gelu",
        num_kv_heads: int | None = None,
        tie_embeddings: bool = False,
        use_bias: bool = True,
        checkpoint: eqx_remat.Checkpoint = None,
        unroll: int | bool = 1,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `vocab_size`: the number of token ids; tokens are ints in
          `[0, vocab_size)`.
        - `max_len`: the longest sequence the model accepts (the size of the
          learned position embedding).
        - `d_model`: the width of the residual stream.
        - `num_heads`: the number of attention (query) heads; must divide
          `d_model`.
        - `num_layers`: the number of decoder blocks (stacked and scanned); >= 1.
        - `d_ff`: the hidden size of each block's MLP. Default `4 * d_model`.
        - `dropout`: the dropout rate, in `[0, 1)`. Default `0.0` (no dropout).
        - `dtype`: the compute dtype of the activations and matrix multiplies,
          e.g. `jnp.bfloat16`. Parameters are always float32 (and are cast inside
          each layer); norms, attention softmax and the returned logits are
          float32. Default `None`: float32 throughout.
        - `attention`: `"xla"` (default), `"dot_product"` or `"flash"` (see
          above).
        - `norm`: `"layer"` (default, `LayerNorm`) or `"rms"` (`RMSNorm`).
        - `position`: `"learned"` (default) or `"rope"` (rotary; needs an even
          head dimension `d_model // num_heads`).
        - `mlp`: `"gelu"` (default) or `"swiglu"`.
        - `num_kv_heads`: the number of key/value heads; must divide `num_heads`.
          Default `num_heads` (multi-head attention); fewer is grouped-query
          attention, 1 multi-query attention.
        - `tie_embeddings`: if `True`, the output head is the transpose of the
          token embedding (no separate head). Default `False`.
        - `use_bias`: whether the linear layers have biases. Default `True`.
        - `checkpoint`: how the stack of blocks is checkpointed: `None`, a policy
          or its name, or a schedule (see [`eqx_remat.scan_layers`][]).
        - `unroll`: layers per iteration of the layer loop (`lax.scan`'s
          `unroll`, see [`eqx_remat.scan_layers`][]): an int >= 1, or `True` for
          the whole stack. Changes compile and step time, never the result.
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
        if num_kv_heads is None:
            num_kv_heads = num_heads
        check_int(cls, "num_kv_heads", num_kv_heads, 1)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"{cls}: num_heads must be divisible by num_kv_heads. "
                f"Got num_heads={num_heads}, num_kv_heads={num_kv_heads}."
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
        _check_choice(cls, "attention", attention, ATTENTIONS)
        _check_choice(cls, "norm", norm, NORMS)
        _check_choice(cls, "position", position, POSITIONS)
        _check_choice(cls, "mlp", mlp, MLPS)
        if position == "rope" and (d_model // num_heads) % 2 != 0:
            raise ValueError(
                f"{cls}: position='rope' needs an even head dimension "
                f"d_model // num_heads. Got {d_model} // {num_heads} = "
                f"{d_model // num_heads}."
            )
        for name, value in (("tie_embeddings", tie_embeddings), ("use_bias", use_bias)):
            if not isinstance(value, bool):
                raise ValueError(f"{cls}: {name} must be a bool. Got {value!r}.")
        check_checkpoint(cls, checkpoint)
        unroll = check_unroll(cls, unroll)

        tkey, pkey, bkey, hkey = jr.split(key, 4)
        self.token_embedding = eqx.nn.Embedding(vocab_size, d_model, key=tkey)
        self.position_embedding = (
            eqx.nn.Embedding(max_len, d_model, key=pkey)
            if position == "learned"
            else None
        )
        self.embedding_dropout = eqx.nn.Dropout(float(dropout))
        self.blocks = eqx_remat.stack(
            lambda k: _Block(
                d_model,
                num_heads,
                num_kv_heads,
                d_ff,
                float(dropout),
                attention,
                norm,
                position,
                mlp,
                use_bias,
                key=k,
            ),
            jr.split(bkey, num_layers),
        )
        self.final_norm = _norm(norm, d_model)
        self.head = (
            None
            if tie_embeddings
            else Dense(d_model, vocab_size, use_bias=False, key=hkey)
        )
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_layers = num_layers
        self.d_ff = d_ff
        self.dropout = float(dropout)
        self.dtype = dtype
        self.attention = attention
        self.norm = norm
        self.position = position
        self.mlp = mlp
        self.tie_embeddings = tie_embeddings
        self.use_bias = use_bias
        self.checkpoint = checkpoint
        self.unroll = unroll

    @classmethod
    def llama(
        cls,
        vocab_size: int,
        max_len: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        *,
        num_kv_heads: int | None = None,
        d_ff: int | None = None,
        attention: Literal["xla", "dot_product", "flash"] = "dot_product",
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
        if num_kv_heads is None:
            groups = max(1, num_heads // 4)
            num_kv_heads = groups if num_heads % groups == 0 else num_heads
        if d_ff is None and isinstance(d_model, int):
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
        # On Explicit mesh axes, the weights outside the scan are gathered whole.
        token_embedding, position_embedding, final_norm, head = _gathered(
            (
                self.token_embedding,
                self.position_embedding,
                self.final_norm,
                self.head,
            )
        )
        x = _embed(token_embedding.weight, tokens)
        if position_embedding is not None:
            x = x + position_embedding.weight[:seq]
        x = x.astype(self.dtype)
        layer_keys = None
        if training:
            ekey, lkey = jr.split(key)
            x = self.embedding_dropout(x, key=ekey)
            layer_keys = jr.split(lkey, self.num_layers)
        x = eqx_remat.scan_layers(
            self.blocks, x, layer_keys, checkpoint=self.checkpoint, unroll=self.unroll
        )
        x = _apply_norm(final_norm, x)
        if head is None:
            logits = _matmul_t(x, token_embedding.weight)
        else:
            logits = head(x)
        return logits.astype(jnp.float32)


def _explicit_mesh(x: Any) -> Any:
    """The mesh of `x`'s type if it has Explicit axes (sharding in types), else
    `None`."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    types = getattr(mesh, "axis_types", ())
    if any(t == jax.sharding.AxisType.Explicit for t in types):
        return mesh
    return None


def _gathered(tree: Any) -> Any:
    """`tree` with every array sharded over Explicit mesh axes gathered to
    replicated — what FSDP does with a layer's weights before using them, and what
    XLA's sharding propagation does by itself on Auto axes (there, and off a mesh,
    arrays are returned unchanged)."""

    def gather(x):
        if not eqx.is_array(x):
            return x
        mesh = _explicit_mesh(x)
        spec = jax.typeof(x).sharding.spec if mesh is not None else ()
        if mesh is None or all(p is None for p in spec):
            return x
        replicated = jax.sharding.NamedSharding(mesh, PartitionSpec())
        return jax.sharding.reshard(x, replicated)

    return jax.tree.map(gather, tree)


def _embed(table: Array, tokens: Array) -> Array:
    """`table[tokens]`. Under a mesh with Explicit axes the gather must be told
    where its output lives: like the tokens, each row whole."""
    mesh = _explicit_mesh(tokens)
    if mesh is None:
        return table[tokens]
    spec = jax.typeof(tokens).sharding.spec
    out = jax.sharding.NamedSharding(mesh, PartitionSpec(*spec, None))
    return table.at[tokens].get(out_sharding=out)

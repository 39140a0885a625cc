"""The causal attention implementations of the Transformer: written out
(`"xla"`), `jax.nn.dot_product_attention` (`"dot_product"`) and the Pallas TPU
flash kernel (`"flash"`)."""

import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array

import eqx_remat.internal

from ._layers import wide
from ._sharding import TENSOR, _mesh_of, _tensor_size


# The attention implementations, by their `Transformer(attention=...)` name.
Attention = Literal["xla", "dot_product", "flash"]
# The Pallas flash kernel's tiles are 128 long: sequences are padded to a multiple.
FLASH_BLOCK = 128


def _xla_attention(q: Array, k: Array, v: Array) -> Array:
    """Causal attention written out: `q` `(seq, heads, hd)`, `k`, `v` `(seq,
    kv_heads, hd)`. Scores and softmax in at least float32; stores `(heads, seq,
    seq)`."""
    seq, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    f = wide(q.dtype)
    if kv_heads == heads:
        scores = jnp.einsum("qhd,khd->hqk", q, k).astype(f)
    else:
        qg = q.reshape(seq, kv_heads, heads // kv_heads, head_dim)
        scores = jnp.einsum("qngd,knd->ngqk", qg, k).astype(f)
    scores = scores / math.sqrt(head_dim)
    scores = jnp.where(causal, scores, jnp.finfo(f).min)
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


def _interpreting() -> bool:
    """Whether Pallas TPU kernels run in interpret mode
    (`jax.experimental.pallas.tpu.force_tpu_interpret_mode()`)."""
    return eqx_remat.internal.pallas_interpreting()


def _flash_attention(q: Array, k: Array, v: Array) -> Array:
    """Causal attention with the Pallas TPU flash kernel: nothing `(seq, seq)`
    leaves the kernel (it keeps per-row softmax statistics for the backward pass).

    One example: `q` `(seq, heads, hd)`, `k`, `v` `(seq, kv_heads, hd)`. The
    kernel wants equal head counts, so grouped keys and values are repeated, and
    tiles of 128, so the sequence is padded at its end (causal attention never
    looks at later positions: the padding changes no real row). On a mesh the
    kernel runs under `jax.shard_map` (XLA cannot partition a Mosaic kernel): each
    device runs it on the examples it holds, and on its heads where a tensor axis
    splits them.
    """
    fa = _flash_module()
    seq, heads, head_dim = q.shape
    mesh = _mesh_of(q)
    platform = eqx_remat.internal.platform_of(q)
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
        # Per example: under `jax.vmap(..., spmd_axis_name=axis)` the batch axis
        # is split over the mesh axis `axis`; the heads over a tensor axis.
        spec = (
            PartitionSpec(None, TENSOR) if _tensor_size(mesh) > 1 else PartitionSpec()
        )
        kernel = jax.shard_map(
            kernel, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
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


def attend(kind: Attention, q: Array, k: Array, v: Array) -> Array:
    """Causal attention of one example by the implementation `kind`: `q`
    `(seq, heads, hd)`, `k`, `v` `(seq, kv_heads, hd)` -> `(seq, heads, hd)`."""
    return _ATTENTION_FNS[kind](q, k, v)

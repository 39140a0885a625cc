"""The Transformer's layers: `Dense` (weights stored `(in, out)`), the norms and
the rotary position embedding."""

import math
from typing import Any, Literal, SupportsIndex, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax import lax
from jaxtyping import Array, Float, PRNGKeyArray

from eqx_remat.internal import check_int

from ._base import check_choice


_T = TypeVar("_T")

# The norms: `"layer"` (LayerNorm, weight and bias), `"rms"` (RMSNorm, weight).
Norm = Literal["layer", "rms"]
# Rotary position embedding: the base of its frequencies (Llama's).
ROPE_BASE = 10000.0
# How tensor parallelism splits a `Dense` (Megatron-LM's column- and row-parallel
# linear layers): its output axis, or its input axis.
Parallel = Literal["columns", "rows"]


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

    `parallel` says how tensor parallelism splits it over a mesh axis named
    `"tensor"` ([`zoo.shard`][]): `"columns"` splits the output axis (each
    device computes some of the outputs: the q/k/v projection by heads, the
    MLP's first matrices), `"rows"` the input axis (each device sums over its
    share of the inputs, and the partial sums are added across the axis: the
    output projections), `None` neither.

    The parameters stay in their own dtype (JAX's default float type) and are
    cast inside the
    product to the input's dtype, so a low-precision compute dtype never
    materialises a second copy of a whole stack's weights.
    """

    weight: Float[Array, "*layers in out"]
    bias: Float[Array, "*layers out"] | None
    parallel: Parallel | None = eqx.field(static=True)

    def __init__(
        self,
        in_size: SupportsIndex,
        out_size: SupportsIndex,
        *,
        use_bias: bool = True,
        parallel: str | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `in_size`: the size of the input's last axis; an int >= 1 (any integer
          type).
        - `out_size`: the size of the output's last axis; an int >= 1 (any
          integer type).
        - `use_bias`: whether to add a bias. (Keyword only.)
        - `parallel`: `"columns"`, `"rows"` or `None` (the default): how
          tensor parallelism splits it (see above). (Keyword only.)
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
        if parallel is not None:
            check_choice("Dense", "parallel", parallel, Parallel)
        self.parallel = parallel  # pyright: ignore[reportAttributeAccessIssue]

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


def _dense_in(tree: _T, dtype: Any) -> _T:
    """`tree` with the arrays of its `Dense` layers cast to `dtype`, as `Dense`
    casts them in its product anyway (the same values): done before a layer's
    weights are gathered (FSDP, `_gathered`), they are gathered in the compute
    dtype, not in float32."""

    def cast(m):
        if not isinstance(m, Dense):
            return m
        return jax.tree.map(lambda a: a.astype(dtype), m)

    return jax.tree.map(cast, tree, is_leaf=lambda m: isinstance(m, Dense))


def _matmul_t(x: Array, weight: Array) -> Array:
    """`x @ weight.T` for a `(out, in)` weight (the tied embedding), contracting
    the input axis directly: a transposed weight would be a new array, and the
    backward pass would save it as a residual."""
    return lax.dot_general(x, weight.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())))


@jax.custom_jvp
def gelu(x: Array) -> Array:
    """`jax.nn.gelu(x)` (tanh approximation), whose derivative is one array: the
    GELU of `zoo.Transformer`.

    Differentiated as written, the tanh formula leaves the backward pass five
    `x`-sized intermediates besides the output (`x`, `x**2`-terms, `tanh`, ...),
    and a plain `lax.scan` (`checkpoint=None`) saves every one of them for every
    layer: on the `fit-a-budget` model, 4 of the 6 `(seq, d_ff)` buffers it saved
    per layer (32 MiB of 95). Here the derivative is computed with the output,
    from `x`, and the tangent is `gelu'(x) * dx`: the backward pass keeps one
    array, `gelu'(x)`; the output itself is kept by the next matrix product.
    Policies that recompute elementwise work (`"dots"`, `"nothing"`) recompute it
    as before."""
    return jax.nn.gelu(x, approximate=True)


@gelu.defjvp
def _gelu_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    c = np.sqrt(2 / np.pi).astype(x.dtype)
    t = jnp.tanh(c * (x + 0.044715 * x**3))
    slope = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    return jax.nn.gelu(x, approximate=True), slope * dx


def _norm(kind: Norm, d_model: int) -> eqx.nn.LayerNorm | eqx.nn.RMSNorm:
    if kind == "layer":
        return eqx.nn.LayerNorm(d_model)
    # Llama's RMSNorm: a weight, no bias.
    return eqx.nn.RMSNorm(d_model, use_bias=False)


def wide(dtype: Any) -> np.dtype:
    """The dtype norms, softmax and rotary embeddings compute in for a compute
    dtype: at least float32 (`float32` for bfloat16, float64 for float64)."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else jnp.dtype(jnp.float32)


def _apply_norm(norm: eqx.nn.LayerNorm | eqx.nn.RMSNorm, x: Array) -> Array:
    """`norm` applied to each row of `x`, in at least float32 (`wide`), returned
    in `x.dtype`.

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
    f = wide(x.dtype)
    x32 = x.astype(f)
    row = (1,) * (x.ndim - 1) + (-1,)
    if norm.weight is None:  # `_norm` always gives the norm a weight
        raise ValueError(f"_apply_norm expected a norm with a weight. Got {norm}.")
    weight = norm.weight.astype(f).reshape(row)
    if isinstance(norm, eqx.nn.LayerNorm):
        mean = jnp.expand_dims(jnp.mean(x32, axis=-1), -1)
        var = jnp.expand_dims(jnp.mean(lax.square(x32 - mean), axis=-1), -1)
        out = (x32 - mean) * (lax.rsqrt(var + norm.eps) * weight)
    else:
        ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        out = x32 * (lax.rsqrt(ms + norm.eps) * weight)
    if norm.bias is not None:
        out = out + norm.bias.astype(f).reshape(row)
    return out.astype(x.dtype)


def _rope(x: Array) -> Array:
    """Rotary position embedding of `x`, `(seq, heads, head_dim)`, positions
    `0 … seq - 1`, rotating the two halves of each head (Llama's convention), in
    at least float32 (`wide`)."""
    seq, _, head_dim = x.shape
    half = head_dim // 2
    f = wide(x.dtype)
    inv_freq = ROPE_BASE ** (-jnp.arange(half, dtype=f) * 2 / head_dim)
    angles = jnp.arange(seq, dtype=f)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x32 = x.astype(f)
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)

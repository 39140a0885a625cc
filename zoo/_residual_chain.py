from typing import ClassVar, SupportsIndex

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from beartype import beartype
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, PRNGKeyArray, jaxtyped

import eqx_remat
from eqx_remat.internal import check_int

from ._base import AbstractModel, as_unroll


class _Residual(eqx.Module):
    """`x -> x + step * tanh(linear(x))`."""

    linear: eqx.nn.Linear
    step: float = eqx.field(static=True)

    def __call__(self, x):
        x = checkpoint_name(x, "layer_input")
        h = checkpoint_name(self.linear(x), "linear")
        # `tanh(h)` is not tagged: its derivative reads the output of `tanh`
        # itself, never a tagged copy, so a policy naming such a tag could not
        # change what the backward pass keeps (save_names would do nothing).
        return x + self.step * jnp.tanh(h)


class ResidualChain(AbstractModel):
    """A deep chain of residual layers, `x ↦ x + f_i(x) / depth` with
    `f_i(x) = tanh(W_i x + b_i)`, stacked and scanned.

    The chain is the explicit Euler discretisation, with step `1 / depth`, of the
    ODE `dx/dt = tanh(W(t) x + b(t))` on `t ∈ [0, 1]`: each layer moves `x` by at
    most `1 / depth` per coordinate, so outputs and gradients stay of order one at
    any depth, thousands of layers included. It is the showcase for the depth
    schedules ([`eqx_remat.recursive`][] and friends), where the layer is cheap and
    the stored carries are what costs memory.

    Each layer tags its intermediates with `jax.ad_checkpoint.checkpoint_name`,
    one tag per name in `ResidualChain.ACTIVATION_NAMES`, for name-based policies
    ([`eqx_remat.save_names`][], [`eqx_remat.save_all_but_names`][], ...):
    `layer_input` (the layer's input `x`) and `linear` (`W_i x + b_i`), both of
    shape `(width,)`. Each changes what [`eqx_remat.save_names`][] keeps;
    `f_i(x)` is not tagged, because the backward pass of `tanh` keeps `tanh`'s
    own output, which no tag can name.
    """

    ACTIVATION_NAMES: ClassVar[tuple[str, ...]] = ("layer_input", "linear")

    layers: _Residual
    width: int = eqx.field(static=True)
    depth: int = eqx.field(static=True)
    checkpoint: eqx_remat.Checkpoint = eqx.field(static=True)
    unroll: int | bool = eqx.field(static=True, converter=as_unroll)

    def __init__(
        self,
        width: SupportsIndex,
        depth: SupportsIndex,
        *,
        checkpoint: eqx_remat.Checkpoint = None,
        unroll: SupportsIndex | bool = 1,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `width`: the size of the state; inputs and outputs have shape `(width,)`.
        - `depth`: the number of residual layers; an int >= 1.
        - `checkpoint`: how the chain is checkpointed: `None`, a policy or its
          name, or a schedule (see [`eqx_remat.scan_layers`][]).
        - `unroll`: layers per iteration of the layer loop (`lax.scan`'s
          `unroll`, see [`eqx_remat.scan_layers`][]): an int >= 1, or `True` for
          the whole stack. Changes compile and step time, never the result.
        - `key`: a `jax.random` key for the initialisation. (Keyword only.)

        Integer arguments take any integer type (`int`, `numpy.int64`, a concrete
        JAX integer) and are stored as Python `int`s.
        """
        width = check_int("ResidualChain", "width", width, 1)
        depth = check_int("ResidualChain", "depth", depth, 1)
        step = 1.0 / depth
        self.layers = eqx_remat.stack(
            lambda k: _Residual(eqx.nn.Linear(width, width, key=k), step),
            jr.split(key, depth),
        )
        self.width = width
        self.depth = depth
        self.checkpoint = checkpoint
        # Stored as an int by the field's converter, which pyright does not model.
        self.unroll = unroll  # pyright: ignore[reportAttributeAccessIssue]

    @jax.named_scope("zoo.ResidualChain")
    @jaxtyped(typechecker=beartype)
    def __call__(
        self, x: Float[Array, " width"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " width"]:
        """**Arguments:**

        - `x`: one input, shape `(width,)`. Batch with `jax.vmap`.
        - `key`: ignored; accepted for a uniform API. (Keyword only.)

        **Returns:**

        The final state, shape `(width,)`.
        """
        del key
        if x.shape != (self.width,):
            raise ValueError(
                f"ResidualChain expected x of shape ({self.width},). Got {x.shape}. "
                "(Batch with jax.vmap.)"
            )
        return eqx_remat.scan_layers(
            self.layers, x, checkpoint=self.checkpoint, unroll=self.unroll
        )

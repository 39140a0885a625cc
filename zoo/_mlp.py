from collections.abc import Callable
from typing import ClassVar, SupportsIndex

import equinox as eqx
import jax
import jax.random as jr
from beartype import beartype
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, PRNGKeyArray, jaxtyped

import eqx_remat
from eqx_remat.internal import check_int

from ._base import AbstractModel, as_unroll


class _Hidden(eqx.Module):
    """One hidden layer, `width_size -> width_size`, followed by the activation."""

    linear: eqx.nn.Linear
    activation: Callable

    def __call__(self, x):
        x = checkpoint_name(x, "layer_input")
        return self.activation(checkpoint_name(self.linear(x), "linear"))


class MLP(AbstractModel):
    """A multi-layer perceptron whose hidden layers are stacked and scanned.

    `in_size -> width_size`, then `depth` hidden layers `width_size -> width_size`
    (applied with [`eqx_remat.scan_layers`][], checkpointed by `checkpoint`), then
    `width_size -> out_size`. The activation follows every layer but the last.

    !!! note
        `depth` counts the *scanned* hidden layers, so the network has `depth + 2`
        linear layers. (In `equinox.nn.MLP`, `depth` counts every layer but the
        first: `equinox.nn.MLP(..., depth=d)` is `zoo.MLP(..., depth=d - 1)`.)

    The hidden layers tag their intermediates with
    `jax.ad_checkpoint.checkpoint_name`, one tag per name in
    `MLP.ACTIVATION_NAMES`, for name-based policies
    ([`eqx_remat.save_names`][], [`eqx_remat.save_all_but_names`][], ...):
    `layer_input` (a hidden layer's input) and `linear` (its linear map, before
    the activation), both of shape `(width_size,)`.
    """

    ACTIVATION_NAMES: ClassVar[tuple[str, ...]] = ("layer_input", "linear")

    layer_in: eqx.nn.Linear
    hidden: _Hidden
    layer_out: eqx.nn.Linear
    activation: Callable
    in_size: int = eqx.field(static=True)
    out_size: int = eqx.field(static=True)
    width_size: int = eqx.field(static=True)
    depth: int = eqx.field(static=True)
    checkpoint: eqx_remat.Checkpoint = eqx.field(static=True)
    unroll: int | bool = eqx.field(static=True, converter=as_unroll)

    def __init__(
        self,
        in_size: SupportsIndex,
        out_size: SupportsIndex,
        width_size: SupportsIndex,
        depth: SupportsIndex,
        *,
        activation: Callable = jax.nn.gelu,
        checkpoint: eqx_remat.Checkpoint = None,
        unroll: SupportsIndex | bool = 1,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `in_size`: the input size; the input is a vector of shape `(in_size,)`.
        - `out_size`: the output size; the output has shape `(out_size,)`.
        - `width_size`: the size of each hidden layer.
        - `depth`: the number of hidden `width_size -> width_size` layers, stacked
          and scanned; an int >= 1.
        - `activation`: applied after every layer but the last. Default `gelu`.
        - `checkpoint`: how the hidden stack is checkpointed: `None`, a policy or
          its name, or a schedule (see [`eqx_remat.scan_layers`][]).
        - `unroll`: layers per iteration of the layer loop (`lax.scan`'s
          `unroll`, see [`eqx_remat.scan_layers`][]): an int >= 1, or `True` for
          the whole stack. Changes compile and step time, never the result.
        - `key`: a `jax.random` key for the initialisation. (Keyword only.)

        Integer arguments take any integer type (`int`, `numpy.int64`, a concrete
        JAX integer) and are stored as Python `int`s.
        """
        in_size = check_int("MLP", "in_size", in_size, 1)
        out_size = check_int("MLP", "out_size", out_size, 1)
        width_size = check_int("MLP", "width_size", width_size, 1)
        depth = check_int("MLP", "depth", depth, 1)
        if not callable(activation):
            raise ValueError(
                "MLP: activation must be a callable, e.g. jax.nn.relu. Got "
                f"{activation!r}."
            )
        kin, khidden, kout = jr.split(key, 3)
        self.layer_in = eqx.nn.Linear(in_size, width_size, key=kin)
        self.hidden = eqx_remat.stack(
            lambda k: _Hidden(eqx.nn.Linear(width_size, width_size, key=k), activation),
            jr.split(khidden, depth),
        )
        self.layer_out = eqx.nn.Linear(width_size, out_size, key=kout)
        self.activation = activation
        self.in_size = in_size
        self.out_size = out_size
        self.width_size = width_size
        self.depth = depth
        self.checkpoint = checkpoint
        # Stored as an int by the field's converter, which pyright does not model.
        self.unroll = unroll  # pyright: ignore[reportAttributeAccessIssue]

    @jax.named_scope("zoo.MLP")
    @jaxtyped(typechecker=beartype)
    def __call__(
        self, x: Float[Array, " in_size"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " out_size"]:
        """**Arguments:**

        - `x`: one input, shape `(in_size,)`. Batch with `jax.vmap`.
        - `key`: ignored; accepted for a uniform API. (Keyword only.)

        **Returns:**

        The output, shape `(out_size,)`.
        """
        del key
        if x.shape != (self.in_size,):
            raise ValueError(
                f"MLP expected x of shape ({self.in_size},). Got {x.shape}. "
                "(Batch with jax.vmap.)"
            )
        h = self.activation(self.layer_in(x))
        h = eqx_remat.scan_layers(
            self.hidden, h, checkpoint=self.checkpoint, unroll=self.unroll
        )
        return self.layer_out(h)

"""`Stacked`: a stack of layers and its checkpoint, as one field of a model of
your own (Haliax's `Stacked`, stanford-crfm/haliax `nn/scan.py`, is the model)."""

from collections.abc import Sequence
from typing import Any, Generic, SupportsIndex, TypeVar, cast

import equinox as eqx
import jax.tree_util as jtu

from ._combinators import check_unroll, scan_stacked, stack_depth, stack_layers
from ._schedules._checkpoint import Checkpoint, check_checkpoint, checkpoint_field


_M = TypeVar("_M")


class Stacked(eqx.Module, Generic[_M]):
    """`D` layers of one structure, stacked with a leading depth axis, and how
    they are checkpointed: a model's list of blocks as one field, applied with one
    [`eqx_remat.scan_layers`][].

    Its `checkpoint` is found by [`eqx_remat.set_checkpoint`][] and
    [`eqx_remat.plan`][] wherever a `Stacked` sits in a model: the model itself
    needs no `checkpoint` field. A model of your own changes in two lines:

    ```python
    import equinox as eqx
    import jax
    import eqx_remat


    class Model(eqx.Module):
        blocks: eqx_remat.Stacked[eqx.nn.Linear]

        def __init__(self, key):
            keys = jax.random.split(key, 4)
            # was: self.blocks = [eqx.nn.Linear(8, 8, key=k) for k in keys]
            self.blocks = eqx_remat.Stacked([eqx.nn.Linear(8, 8, key=k) for k in keys])

        def __call__(self, x):
            # was: for block in self.blocks: x = block(x)
            return self.blocks(x)


    model = eqx_remat.set_checkpoint(Model(jax.random.key(0)), "dots")
    print(model.blocks.checkpoint, len(model.blocks), model(jax.numpy.ones(8)).shape)
    ```

    ```text
    dots 4 (8,)
    ```

    The layers are stacked once, when the `Stacked` is built: a training step
    that receives the model reads them in place, and traces one layer whatever
    their number. (A list passed to `scan_layers` is traced layer by layer,
    and on the CPU of jaxlib 0.10, checkpointed, is copied into a stack on
    every step: see [`eqx_remat.StackedListWarning`][].)

    **Attributes:**

    - `layers`: the layers, one layer whose arrays have a leading depth axis
      (`layers.weight` of shape `(D, ...)`).
    - `checkpoint`: how the stack is checkpointed (static): `None`, a policy or
      its name, or a schedule, as [`eqx_remat.scan_layers`][] takes it.
    - `unroll`: `scan_layers`' `unroll` (static).
    """

    layers: _M
    checkpoint: Checkpoint = checkpoint_field(default=None)
    unroll: int | bool = eqx.field(static=True, default=1)

    def __init__(
        self,
        layers: Sequence[_M] | _M,
        *,
        checkpoint: Checkpoint = None,
        unroll: SupportsIndex | bool = 1,
    ):
        """**Arguments:**

        - `layers`: a non-empty list or tuple of `eqx.Module`s of one structure
          (the same type, static fields, array shapes and dtypes), stacked here
          with `jnp.stack` on each array; or layers already stacked with a
          leading depth axis, e.g. by [`eqx_remat.stack`][]`(make_layer, keys)`.
        - `checkpoint`: `None` (no checkpointing), a policy or its name, or a
          schedule ([`eqx_remat.every`][], [`eqx_remat.recursive`][], ...).
        - `unroll`: layers per loop iteration: an int >= 1 or `True`, as in
          [`eqx_remat.scan_layers`][].

        **Raises:**

        `ValueError` naming the argument: an invalid `checkpoint` or `unroll`,
        an empty list, layers that differ (the first one that does, and how),
        or a stack whose arrays do not share one leading depth axis.
        """
        if isinstance(layers, (list, tuple)):
            layers = stack_layers(layers, fn="Stacked", what="layers")
        else:
            stack_depth(layers, "layers", fn="Stacked")
        # A list of `_M`s stacks into one `_M`, which pyright cannot follow.
        self.layers = cast(_M, layers)
        self.checkpoint = check_checkpoint(checkpoint, name="Stacked: checkpoint")
        try:
            self.unroll = check_unroll(unroll)
        except ValueError as e:
            raise ValueError(str(e).replace("scan_layers", "Stacked", 1)) from None

    def __call__(self, carry: Any, xs: Any = None) -> Any:
        """Apply the layers in order: `carry = layers[i](carry)`, or
        `layers[i](carry, xs[i])` when `xs` is given.

        **Arguments:**

        - `carry`: the input of the first layer (any pytree of arrays).
        - `xs`: optional per-layer inputs with a leading depth axis `D`
          (dropout keys, positions, ...).

        **Returns:**

        The output of the last layer.
        """
        return scan_stacked(
            self.layers, carry, xs, checkpoint=self.checkpoint, unroll=self.unroll
        )

    def __len__(self) -> int:
        """The number of layers, `D`."""
        return stack_depth(self.layers, "layers", fn="Stacked")

    def unstacked(self) -> list[_M]:
        """The layers as a list of `D` separate layers (a copy of each)."""
        params, static = eqx.partition(self.layers, eqx.is_array)
        return [
            eqx.combine(jtu.tree_map(lambda x, i=i: x[i], params), static)
            for i in range(len(self))
        ]

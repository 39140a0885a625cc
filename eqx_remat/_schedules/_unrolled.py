"""A Python list of layers, checkpointed where the layers are: the same
checkpoints as for a stack, without stacking the list.

A `lax.scan` reads its layers from one array with a leading depth axis; a list
of separately held layers becomes one only by copying them (`jnp.stack`, inside
every step), and its gradient is stacked too before it is split per layer. Here
the list is traced layer by layer instead, as the user's own Python loop is:

- `None`: each layer in turn;
- a policy: `jax.checkpoint` on each layer;
- a schedule: nested `jax.checkpoint`s over segments of the list
  (`Schedule.unrolled`): a segment keeps only its input on the forward pass,
  and recomputes its children on the backward pass, keeping theirs.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax

from .._inspect._offload import on_device
from .._policies._apply import checkpointed
from .._policies._values import Policy
from ._checkpoint import Checkpoint, normalise_checkpoint
from ._engine import Schedule


Layer = Callable[[Any], Any]
"""One layer of a list: `carry -> carry`, closing over its parameters."""


def unrolls(checkpoint: Checkpoint) -> bool:
    """Whether a list can be checkpointed by `checkpoint` in place: `None`, a
    policy, or a schedule that implements `Schedule.unrolled` (every schedule of
    this library; one of your own may not)."""
    c = normalise_checkpoint(checkpoint)
    return not isinstance(c, Schedule) or type(c).unrolled is not Schedule.unrolled


def run_unrolled(layers: Sequence[Layer], carry: Any, checkpoint: Checkpoint) -> Any:
    """`carry = layer(carry)` for each layer, checkpointed by `checkpoint` (for
    which `unrolls` holds)."""
    c = normalise_checkpoint(checkpoint)
    if isinstance(c, Schedule):
        c.check_depth(len(layers))
        return c.unrolled(layers, carry)
    return each(layers, carry, c)


def each(layers: Sequence[Layer], carry: Any, policy: Policy | None) -> Any:
    """Each layer in turn, under `jax.checkpoint` with `policy` (saving the
    layer's input and what the policy saves), or as it is for `None`."""
    for layer in layers:
        f = (
            layer
            if policy is None
            else checkpointed(layer, on_device(policy), prevent_cse=True)
        )
        carry = f(carry)
    return carry


def segment(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`fn` keeping only its input on the forward pass: the backward pass runs
    it again (what it checkpoints inside keeps what it keeps)."""
    return jax.checkpoint(fn, prevent_cse=True)

"""What every zoo model has, and the argument checks the models share."""

import operator
import typing
from typing import Any

import equinox as eqx

import eqx_remat
from eqx_remat.internal import check_checkpoint, check_int


class AbstractModel(eqx.Module):
    """The contract of a zoo model: what [`zoo.MLP`][], [`zoo.ResidualChain`][]
    and [`zoo.Transformer`][] have, and what a new model must have.

    A zoo model stacks its repeated layers with [`eqx_remat.stack`][], applies
    them with [`eqx_remat.scan_layers`][] and declares, as concrete fields and
    class attributes:

    - `checkpoint: eqx_remat.Checkpoint = eqx.field(static=True)`: how the stack
      is checkpointed (`None`, a policy or its name, or a schedule), passed to
      `scan_layers`; [`eqx_remat.set_checkpoint`][] replaces it.
    - `unroll: int | bool = eqx.field(static=True)`: `scan_layers`' `unroll`,
      an int >= 1 or `True` for the whole stack. (The zoo's models store any
      integer type as a Python `int`, with a field converter.)
    - `ACTIVATION_NAMES: ClassVar[tuple[str, ...]]`: the
      `jax.ad_checkpoint.checkpoint_name` tags its layers attach to their
      intermediates, for name-based policies ([`eqx_remat.save_names`][], ...).

    Both fields are validated when the model is built (`__check_init__`): an
    invalid `checkpoint` or `unroll` is a `ValueError` naming the model's class.
    """

    if typing.TYPE_CHECKING:
        # Pyright does not read equinox's `AbstractClassVar` (`ClassVar` under
        # another name) as a `ClassVar`, and would take the models' `ClassVar`s
        # for overrides of an instance variable.
        ACTIVATION_NAMES: typing.ClassVar[tuple[str, ...]]
    else:
        ACTIVATION_NAMES: eqx.AbstractClassVar[tuple[str, ...]]
    checkpoint: eqx.AbstractVar[eqx_remat.Checkpoint]
    unroll: eqx.AbstractVar[int | bool]

    @property
    def activation_names(self) -> tuple[str, ...]:
        """The `checkpoint_name` tags in this model's layers: `ACTIVATION_NAMES`,
        unless the model's options change them (see [`zoo.Transformer`][])."""
        return self.ACTIVATION_NAMES

    def __check_init__(self):
        cls = type(self).__name__
        check_checkpoint(self.checkpoint, name=f"{cls}: checkpoint")
        if not isinstance(self.unroll, bool):
            check_int(cls, "unroll", self.unroll, 1)


def as_unroll(value: Any) -> Any:
    """The converter of a zoo model's `unroll` field: `True`/`False` as they
    are, any integer type (`numpy.int64`, a concrete JAX integer: whatever
    `operator.index` takes) as a Python `int`. Anything else is returned as it
    is, for [`zoo.AbstractModel`][]'s check to reject with the model's name.
    (Private to the zoo: a new model may use it or store an `int` itself.)

    **Arguments:**

    - `value`: the `unroll` argument of a model's `__init__`.

    **Returns:**

    `value`, as a `bool` or an `int` where it is one.
    """
    if isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def check_choice(cls: str, name: str, value: Any, choices: Any) -> None:
    """Raise a `ValueError` naming `cls` and `name`, and listing the options,
    unless `value` is one of the strings of the `Literal` type `choices`."""
    options = typing.get_args(choices)
    if not isinstance(value, str) or value not in options:
        raise ValueError(
            f"{cls}: unknown {name} {value!r}. It needs to be one of {list(options)}."
        )

"""Integer arguments: the check shared by the combinators, the schedules, the
planner and the zoo (through `eqx_remat.internal`). A `checkpoint` value is checked
in `_checkpoint.py`.

Errors are `ValueError`s that name the function and the argument, say what was
expected and what was got, as Equinox's do.
"""

import operator
from typing import Any


def check_int(fn: str, arg: str, value: Any, minimum: int) -> int:
    """Check that `value` is an integer `>= minimum` and return it as an `int`.

    Any integer type is accepted (`int`, `numpy.int64`, a concrete integer JAX
    scalar: whatever `operator.index` accepts); `bool` is not.

    **Arguments:**

    - `fn`: the name of the function or class being called, for the message
      (e.g. `"every"`, `"zoo.MLP"`).
    - `arg`: the name of the argument, for the message.
    - `value`: the value to check.
    - `minimum`: the smallest allowed value.

    **Returns:**

    `value` as a Python `int`.

    **Raises:**

    `ValueError` naming `fn` and `arg` when `value` is not an integer or is less
    than `minimum`.
    """
    if isinstance(value, bool):
        index = None
    else:
        try:
            index = operator.index(value)
        except TypeError:
            index = None
    if index is None:
        raise ValueError(
            f"{fn}: {arg} must be an int >= {minimum}. "
            f"Got {value!r} of type {type(value).__name__}."
        )
    if index < minimum:
        raise ValueError(f"{fn}: {arg} must be an int >= {minimum}. Got {index}.")
    return index

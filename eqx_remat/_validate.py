"""Argument checks shared by the combinators, the schedules, the planner and the zoo.

Errors are `ValueError`s that name the function and the argument, say what was
expected and what was got, as Equinox's do.
"""

import operator
from typing import Any

from ._policies import policy as _normalise_policy


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


def check_policy(fn: str, value: Any) -> None:
    """Check that `value` is a policy: `None`, a name from
    [`eqx_remat.POLICIES`][] or a JAX policy callable.

    **Arguments:**

    - `fn`: the name of the function being called, for the message.
    - `value`: the value to check.

    **Raises:**

    `ValueError` naming `fn`, listing the valid policy names.
    """
    try:
        _normalise_policy(value)
    except ValueError as e:
        raise ValueError(f"{fn}: invalid policy. {e}") from None


def check_checkpoint(spec: Any, *, name: str = "checkpoint") -> Any:
    """Check that `spec` can be a `checkpoint`: `None`, a policy name, a JAX
    policy callable or a [`eqx_remat.Schedule`][].

    The check every `checkpoint` argument goes through: the combinators',
    [`eqx_remat.set_checkpoint`][]'s, [`eqx_remat.plan`][]'s candidates and the
    zoo's constructors. A model of your own can call it in its `__init__`:

    ```python
    import eqx_remat

    eqx_remat.check_checkpoint(eqx_remat.every(4))  # fine
    try:
        eqx_remat.check_checkpoint("dot", name="MyModel: checkpoint")
    except ValueError as e:
        print(str(e)[:60])
    ```

    ```text
    MyModel: checkpoint expected None, a policy name, a JAX poli
    ```

    **Arguments:**

    - `spec`: the value to check.
    - `name`: what to call it in the message (e.g. `"MLP: checkpoint"`).

    **Returns:**

    `spec`, unchanged.

    **Raises:**

    `ValueError` starting with `name`, listing the valid policy names.
    """
    from ._schedules import Schedule  # _schedules imports this module

    if isinstance(spec, Schedule):
        return spec
    try:
        _normalise_policy(spec)
    except ValueError as e:
        raise ValueError(
            f"{name} expected None, a policy name, a JAX policy or a schedule "
            f"(eqx_remat.every, nested, recursive, binomial). {e}"
        ) from None
    return spec

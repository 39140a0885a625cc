"""Argument checks shared by the zoo's constructors."""

from typing import Any

import eqx_remat


def check_int(cls: str, arg: str, value: Any, minimum: int) -> None:
    """Raise a `ValueError` naming `cls` and `arg` unless `value` is an int >=
    `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{cls}: {arg} must be an int >= {minimum}. "
            f"Got {value!r} of type {type(value).__name__}."
        )
    if value < minimum:
        raise ValueError(f"{cls}: {arg} must be an int >= {minimum}. Got {value}.")


def check_checkpoint(cls: str, checkpoint: Any) -> None:
    """Raise a `ValueError` naming `cls` unless `checkpoint` is `None`, a policy
    name, a JAX policy callable or a schedule."""
    if isinstance(checkpoint, eqx_remat.Schedule):
        return
    try:
        eqx_remat.policy(checkpoint)
    except ValueError as e:
        raise ValueError(
            f"{cls}: checkpoint must be None, a policy name, a JAX policy or a "
            f"schedule (eqx_remat.every, nested, recursive, ...). {e}"
        ) from None

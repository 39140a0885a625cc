"""Argument checks shared by the zoo's constructors: eqx_remat's public ones."""

from typing import Any

import eqx_remat


check_int = eqx_remat.internal.check_int


def check_checkpoint(cls: str, checkpoint: Any) -> None:
    """Raise a `ValueError` naming `cls` unless `checkpoint` is `None`, a policy
    name, a JAX policy callable or a schedule."""
    eqx_remat.internal.check_checkpoint(checkpoint, name=f"{cls}: checkpoint")


def check_unroll(cls: str, unroll: Any) -> int | bool:
    """`unroll` as `scan_layers` takes it: an int >= 1, or a bool. Raises a
    `ValueError` naming `cls` otherwise."""
    if isinstance(unroll, bool):
        return unroll
    return eqx_remat.internal.check_int(cls, "unroll", unroll, 1)

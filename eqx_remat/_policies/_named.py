"""The named policies (`eqx_remat.POLICIES`) and the one normaliser of a policy
specification (`eqx_remat.policy`)."""

import inspect
import types
from collections.abc import Mapping
from typing import Any

import jax

from ._values import Offloading, Policy


_cp = jax.checkpoint_policies


POLICIES: Mapping[str, Policy] = types.MappingProxyType(
    {
        "everything": _cp.everything_saveable,
        "nothing": _cp.nothing_saveable,
        "dots": _cp.dots_saveable,
        "dots_no_batch": _cp.dots_with_no_batch_dims_saveable,
        "offload_dots_no_batch": Offloading(
            _cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
            "dots_no_batch, device -> pinned_host",
        ),
    }
)
"""The named policies: a read-only mapping from a short name to a JAX policy.

| name | saves |
|---|---|
| `"everything"` | every intermediate (checkpointing only the layer boundary) |
| `"nothing"` | nothing but the layer's inputs |
| `"dots"` | the outputs of matrix multiplies |
| `"dots_no_batch"` | matrix multiplies without batch dimensions |
| `"offload_dots_no_batch"` | the same, offloaded to pinned host memory |

Offloading policies support first-order reverse mode and forward-over-reverse;
differentiating their backward pass again (grad of grad) raises a
`NotImplementedError` at trace time (see [`eqx_remat.offload_names`][]).
"""


def policy(spec: Any) -> Policy | None:
    """Normalise a policy specification into a JAX policy.

    **Arguments:**

    - `spec`: `None`, a name from [`eqx_remat.POLICIES`][], or a JAX policy callable
      (e.g. `jax.checkpoint_policies.dots_saveable`, or [`eqx_remat.save_names`][]).

    **Returns:**

    `None` for `None`, else a callable policy for `jax.checkpoint`.

    **Raises:**

    `ValueError` for an unknown name, listing the valid ones.
    """
    return to_jax_policy(spec)


def to_jax_policy(spec: Any, *, fn: str | None = None) -> Policy | None:
    """What [`eqx_remat.policy`][] returns for `spec`: the one check of a policy,
    for the modules that take one (the engine, the checkpoint value, the
    schedules' inner policies). With `fn`, the function whose argument it is
    (`"every"`), a message starts `"{fn}: invalid policy."`."""
    prefix = "" if fn is None else f"{fn}: invalid policy. "
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            return POLICIES[spec]
        except KeyError:
            raise ValueError(
                f"{prefix}Unknown policy {spec!r}. It needs to be one of "
                f"{sorted(POLICIES)}, or a JAX policy callable."
            ) from None
    if callable(spec) and not isinstance(spec, type):
        try:
            signature = inspect.signature(spec)
        except (TypeError, ValueError):  # some builtins have none: unchecked
            return spec
        try:  # how JAX calls a policy, e.g. for a dot_general
            signature.bind(jax.lax.dot_general_p, None, None, dimension_numbers=None)
        except TypeError as e:
            raise ValueError(
                f"{prefix}A policy callable is called by JAX as policy(primitive, "
                f"*avals, **params) and returns whether to save the result. Got "
                f"{spec!r}, which cannot be called so: {e}."
            ) from None
        return spec
    raise ValueError(
        f"{prefix}policy expected None, a policy name (one of "
        f"{sorted(POLICIES)}) or a JAX policy callable. Got {spec!r}."
    )

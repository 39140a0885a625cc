"""Policies: what one layer saves for the backward pass.

A policy is what `jax.checkpoint(..., policy=...)` takes: a function called on each
primitive of the checkpointed function that says whether its output is saved
(`True`), recomputed (`False`) or offloaded to another memory space.
"""

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import jax
from jax.ad_checkpoint import checkpoint_name  # noqa: F401  (re-exported for users)


Policy: TypeAlias = Callable[..., Any]

_cp = jax.checkpoint_policies


def _is_name(prim: Any, params: dict) -> bool:
    # `checkpoint_name(x, name)` binds the primitive "name" with a `name` parameter.
    return getattr(prim, "name", None) == "name" and "name" in params


@dataclasses.dataclass(frozen=True)
class save_names:
    """Save only the values tagged with one of `names` (by
    `jax.ad_checkpoint.checkpoint_name`); recompute everything else.

    Compares and hashes by value, so rebuilding the same policy does not trigger
    recompilation.

    **Arguments:**

    - `*names`: the `checkpoint_name` tags to save.
    """

    names: frozenset[str]

    def __init__(self, *names: str):
        _check_names("save_names", names)
        object.__setattr__(self, "names", frozenset(names))

    def __call__(self, prim, *_, **params) -> bool:
        return _is_name(prim, params) and params["name"] in self.names


@dataclasses.dataclass(frozen=True)
class save_all_but_names:
    """Save everything the backward pass needs except the values tagged with one of
    `names`, which are recomputed.

    Unlike `jax.checkpoint_policies.save_anything_except_these_names` in jax 0.10.2
    (which ignores its names and saves everything), this really excludes the named
    values: a tagged value is recomputed from the inputs of the operation that
    produced it.

    Compares and hashes by value.

    **Arguments:**

    - `*names`: the `checkpoint_name` tags not to save.
    """

    names: frozenset[str]

    def __init__(self, *names: str):
        _check_names("save_all_but_names", names)
        object.__setattr__(self, "names", frozenset(names))

    def __call__(self, prim, *_, **params) -> bool:
        if _is_name(prim, params):
            return params["name"] not in self.names
        return True


@dataclasses.dataclass(frozen=True)
class offload_names:
    """Offload the values tagged with one of `names` from memory space `src` to
    `dst` (on the forward pass) and back (on the backward pass); recompute
    everything else.

    Offloading needs a backend with a host memory space (TPU, GPU); on the CPU the
    values stay where they are.

    Compares and hashes by value.

    **Arguments:**

    - `*names`: the `checkpoint_name` tags to offload.
    - `src`: the memory space the values are computed in. Default `"device"`.
    - `dst`: where they are kept until the backward pass. Default `"pinned_host"`.
    """

    names: frozenset[str]
    src: str
    dst: str

    def __init__(self, *names: str, src: str = "device", dst: str = "pinned_host"):
        _check_names("offload_names", names)
        for arg, value in (("src", src), ("dst", dst)):
            if not isinstance(value, str):
                raise ValueError(
                    f"offload_names: {arg} must be a memory-space name like "
                    f"'device' or 'pinned_host'. Got {value!r}."
                )
        object.__setattr__(self, "names", frozenset(names))
        object.__setattr__(self, "src", src)
        object.__setattr__(self, "dst", dst)

    def __call__(self, prim, *args, **params):
        return self._jax_policy(prim, *args, **params)

    @property
    def _jax_policy(self) -> Policy:
        return _offload_policy(self.names, self.src, self.dst)


_OFFLOAD_CACHE: dict = {}


def _offload_policy(names: frozenset[str], src: str, dst: str) -> Policy:
    key = (names, src, dst)
    if key not in _OFFLOAD_CACHE:
        _OFFLOAD_CACHE[key] = _cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=sorted(names),
            offload_src=src,
            offload_dst=dst,
        )
    return _OFFLOAD_CACHE[key]


def _check_names(fn: str, names: tuple) -> None:
    if len(names) == 0:
        raise ValueError(f"{fn} expected at least one name. Got none.")
    for n in names:
        if not isinstance(n, str):
            raise ValueError(
                f"{fn} expected names as strings (the tags given to "
                f"`checkpoint_name`). Got {n!r} of type {type(n).__name__}."
            )


POLICIES: Mapping[str, Policy] = types.MappingProxyType(
    {
        "everything": _cp.everything_saveable,
        "nothing": _cp.nothing_saveable,
        "dots": _cp.dots_saveable,
        "dots_no_batch": _cp.dots_with_no_batch_dims_saveable,
        "offload_dots_no_batch": _cp.offload_dot_with_no_batch_dims(
            "device", "pinned_host"
        ),
    }
)
"""The named policies: a read-only mapping from a short name to a JAX policy.

| name | saves |
|---|---|
| `"everything"` | every intermediate (checkpointing only the layer boundary) |
| `"nothing"` | nothing but the layer's inputs |
| `"dots"` | the outputs of matrix multiplies |
| `"dots_no_batch"` | matrix multiplies without batch dimensions (weights × activations) |
| `"offload_dots_no_batch"` | the same, offloaded to pinned host memory |
"""


def policy(spec: "None | str | Policy") -> Policy | None:
    """Normalise a policy specification into a JAX policy.

    **Arguments:**

    - `spec`: `None`, a name from [`eqx_remat.POLICIES`][], or a JAX policy callable
      (e.g. `jax.checkpoint_policies.dots_saveable`, or [`eqx_remat.save_names`][]).

    **Returns:**

    `None` for `None`, else a callable policy for `jax.checkpoint`.

    **Raises:**

    `ValueError` for an unknown name, listing the valid ones.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            return POLICIES[spec]
        except KeyError:
            raise ValueError(
                f"Unknown policy {spec!r}. It needs to be one of "
                f"{sorted(POLICIES)}, or a JAX policy callable."
            ) from None
    if callable(spec) and not isinstance(spec, type):
        return spec
    raise ValueError(
        "policy expected None, a policy name (one of "
        f"{sorted(POLICIES)}) or a JAX policy callable. Got {spec!r}."
    )

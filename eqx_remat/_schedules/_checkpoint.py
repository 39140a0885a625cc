"""The checkpoint value: the `Checkpoint` type of every `checkpoint` field, its
normalisation and validation (once, here), and the one walk over the `checkpoint`
fields of a pytree, behind `set_checkpoint` and `plan`.

Errors are `ValueError`s that name the function and the argument, say what was
expected and what was got, as Equinox's do.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar

import equinox as eqx
import jax.tree_util as jtu

from .._policies._named import to_jax_policy
from .._policies._values import Policy
from ._engine import Schedule


_T = TypeVar("_T")


Checkpoint: TypeAlias = None | str | Callable[..., Any] | Schedule
"""The type of every `checkpoint` field: `None` (no checkpointing), a policy name,
a JAX policy callable, or a [`eqx_remat.Schedule`][]."""


# The schedules a `checkpoint` may be, as messages list them; a part of a
# `ranges(...)` may be any of them but `ranges`.
_SCHEDULES = "eqx_remat.every, nested, recursive, binomial, ranges"
_SCHEDULES_IN_RANGES = "eqx_remat.every, nested, recursive, binomial"


def normalise_checkpoint(
    spec: Any, *, name: str = "checkpoint", schedules: str = _SCHEDULES
) -> Schedule | Policy | None:
    """`spec` as it is applied: a schedule as it is, a policy or its name as a
    JAX policy, `None` as `None`.

    **Raises:**

    `ValueError` starting with `name`, listing the valid policy names and the
    `schedules` accepted there.
    """
    if isinstance(spec, Schedule):
        return spec
    try:
        return to_jax_policy(spec)
    except ValueError as e:
        raise ValueError(
            f"{name} expected None, a policy name, a JAX policy or a schedule "
            f"({schedules}). {e}"
        ) from None


def check_checkpoint(
    spec: Any, *, name: str = "checkpoint", schedules: str = _SCHEDULES
) -> Checkpoint:
    """Check that `spec` can be a `checkpoint`: `None`, a policy name, a JAX
    policy callable or a [`eqx_remat.Schedule`][].

    The check every `checkpoint` argument goes through: the combinators',
    [`eqx_remat.set_checkpoint`][]'s, [`eqx_remat.plan`][]'s candidates and the
    zoo's constructors. A model of your own can call it in its `__init__`:

    ```python
    import eqx_remat

    eqx_remat.internal.check_checkpoint(eqx_remat.every(4))  # fine
    try:
        eqx_remat.internal.check_checkpoint("dot", name="MyModel: checkpoint")
    except ValueError as e:
        print(str(e)[:60])
    ```

    ```text
    MyModel: checkpoint expected None, a policy name, a JAX poli
    ```

    **Arguments:**

    - `spec`: the value to check.
    - `name`: what to call it in the message (e.g. `"MLP: checkpoint"`).
    - `schedules`: the schedules the message lists as accepted.

    **Returns:**

    `spec`, unchanged.

    **Raises:**

    `ValueError` starting with `name`, listing the valid policy names.
    """
    normalise_checkpoint(spec, name=name, schedules=schedules)
    return spec


def _is_module(x: Any) -> bool:
    return isinstance(x, eqx.Module)


_CHECKPOINT_FIELD = "eqx_remat.checkpoint"


def checkpoint_field(**kwargs: Any) -> Any:
    """`eqx.field(static=True, **kwargs)`, declared as holding a `Checkpoint`:
    `map_checkpoints` finds such a field by this declaration, whatever its
    name ([`eqx_remat.Stacked`][]'s `checkpoint` is one)."""
    metadata = dict(kwargs.pop("metadata", {}), **{_CHECKPOINT_FIELD: True})
    return eqx.field(static=True, metadata=metadata, **kwargs)


def _is_checkpoint_field(f: dataclasses.Field) -> bool:
    return f.name == "checkpoint" or bool(f.metadata.get(_CHECKPOINT_FIELD))


def map_fields(
    tree: _T, is_field: Callable[[dataclasses.Field], bool], fn: Callable[[Any], Any]
) -> tuple[_T, list[Any]]:
    """The one walk over a kind of module field: a copy of `tree` in which the
    value `v` of every field `f` with `is_field(f)` of every `eqx.Module`
    (modules nested inside others included) is replaced by `fn(v)`, and the
    list of the fields' old values, in the order met. The rest of the tree,
    arrays included, is kept as it is."""
    found: list[Any] = []

    def replace(x):
        if not _is_module(x):
            return x
        new = object.__new__(type(x))
        for f in dataclasses.fields(x):
            value = getattr(x, f.name)
            if is_field(f):
                found.append(value)
                value = fn(value)
            else:
                value = jtu.tree_map(replace, value, is_leaf=_is_module)
            object.__setattr__(new, f.name, value)
        return new

    out = jtu.tree_map(replace, tree, is_leaf=_is_module)
    return out, found


def map_checkpoints(
    tree: _T, fn: Callable[[Checkpoint], Checkpoint]
) -> tuple[_T, list[Checkpoint]]:
    """`map_fields` over checkpoint fields: one declared with
    `checkpoint_field()` — the `checkpoint` of an [`eqx_remat.Stacked`][],
    wherever it sits in a model — or any field named `checkpoint` (the zoo's
    models, and models of your own that follow them)."""
    return map_fields(tree, _is_checkpoint_field, fn)


def map_loss_chunk_sizes(
    tree: _T, fn: Callable[[int | None], int | None]
) -> tuple[_T, list[int | None]]:
    """`map_fields` over fields named `loss_chunk_size` (a
    `zoo.Transformer`'s, and models of your own that follow it)."""
    return map_fields(tree, lambda f: f.name == "loss_chunk_size", fn)


def set_checkpoint(tree: _T, spec: Checkpoint) -> _T:
    """A copy of `tree` with every `checkpoint` field replaced by `spec`.

    Works on any pytree: zoo models, modules nested inside other modules, lists of
    models, models of your own that hold their layers in an
    [`eqx_remat.Stacked`][] (its `checkpoint` is found wherever it sits). Use it
    to change the schedule of a trained model, or to compare schedules on the
    same weights.

    The `checkpoint` field is static: it is part of the tree's structure, and so
    of the structure of anything built from the model — an optimiser state made
    by `optimiser.init(eqx.filter(model, eqx.is_array))` holds copies of the
    model's modules (Adam's `mu` and `nu`). To switch the checkpoint of a model
    being trained, switch both in one call, so that the next update sees
    matching structures:

    ```python
    model, opt_state = eqx_remat.set_checkpoint((model, opt_state), "dots")
    ```

    **Arguments:**

    - `tree`: any pytree containing `eqx.Module`s with a `checkpoint` field
      (an [`eqx_remat.Stacked`][], a zoo model).
    - `spec`: the new checkpoint: `None`, a policy or its name, or a schedule.

    **Returns:**

    The same pytree, with the same arrays, and `spec` in every `checkpoint` field.

    **Raises:**

    `ValueError` for an invalid `spec`, or when `tree` holds no module with a
    `checkpoint` field (a wrong or mistyped tree would otherwise silently get no
    checkpointing).
    """
    check_checkpoint(spec, name="set_checkpoint: spec")
    out, found = map_checkpoints(tree, lambda _: spec)
    if not found:
        raise ValueError(
            "set_checkpoint expected a pytree containing an eqx.Module with a "
            "`checkpoint` field (an eqx_remat.Stacked, every zoo model). Got "
            f"{type(tree).__name__} without one: nothing would be checkpointed."
        )
    return out

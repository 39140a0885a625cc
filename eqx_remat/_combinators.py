"""Combinators: stack layers, scan over them, chain callables."""

from collections.abc import Callable, Sequence
from typing import Any, SupportsIndex, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax

from ._checkpoint import Checkpoint, normalise_checkpoint
from ._engine import Schedule, remat_scan
from ._policies import checkpointed
from ._validate import check_int


_T = TypeVar("_T")


def stack(make_layer: Callable[[Any], _T], keys: Any) -> _T:
    """Build `D` layers with a leading depth axis on every array.

    **Arguments:**

    - `make_layer`: a function from one PRNG key to one layer (any pytree, e.g. an
      `eqx.Module`).
    - `keys`: the keys, shape `(D, ...)` — typically `jax.random.split(key, D)`.

    **Returns:**

    One layer of the same type whose arrays have a leading axis of size `D`, ready
    for [`eqx_remat.scan_layers`][].
    """
    shape = jnp.shape(keys)
    if len(shape) == 0 or (
        not jax.dtypes.issubdtype(jnp.asarray(keys).dtype, jax.dtypes.prng_key)
        and len(shape) < 2
    ):
        raise ValueError(
            "stack expected keys with a leading depth axis, e.g. "
            f"jax.random.split(key, depth). Got keys of shape {shape}."
        )
    if shape[0] == 0:
        raise ValueError("stack expected at least one key (depth >= 1). Got 0 keys.")
    return eqx.filter_vmap(make_layer)(keys)


def _depth(stacked: Any, what: str) -> int:
    leaves = jtu.tree_leaves(eqx.filter(stacked, eqx.is_array))
    if not leaves:
        raise ValueError(f"scan_layers expected {what} to hold arrays. Got none.")
    depths = {jnp.ndim(x) and x.shape[0] for x in leaves}
    if any(jnp.ndim(x) == 0 for x in leaves):
        raise ValueError(
            f"scan_layers expected every array in {what} to have a leading depth "
            "axis. Got a scalar."
        )
    if len(depths) != 1:
        raise ValueError(
            f"scan_layers expected every array in {what} to have the same leading "
            f"depth axis. Got depths {sorted(depths)}."
        )
    return depths.pop()


def _apply(
    step: Callable[[Any, Any, Any], Any],
    consts: Any,
    stacked: Any,
    carry: Any,
    depth: int,
    checkpoint: Checkpoint,
    unroll: SupportsIndex = 1,
) -> Any:
    """`for i in range(depth): carry = step(consts, stacked[i], carry)`."""
    if depth < 1:
        raise ValueError(f"Expected a depth >= 1 (at least one layer). Got {depth}.")
    checkpoint = normalise_checkpoint(checkpoint)
    unroll = _check_unroll(unroll)  # a Python value: `lax.scan` hashes it
    if isinstance(checkpoint, Schedule):
        return remat_scan(step, consts, stacked, carry, depth, checkpoint, unroll)
    body = lambda c, s: (step(consts, s, c), None)
    if checkpoint is not None:
        body = checkpointed(body, checkpoint)
    return lax.scan(body, carry, stacked, length=depth, unroll=unroll)[0]


def _check_unroll(unroll: Any) -> int | bool:
    """`unroll` as `lax.scan` takes it: a bool, or any integer type as an `int`."""
    if isinstance(unroll, bool):
        return unroll
    return check_int("scan_layers", "unroll", unroll, 1)


def scan_layers(
    layers: Any,
    carry: Any,
    xs: Any = None,
    *,
    checkpoint: Checkpoint = None,
    unroll: SupportsIndex | bool = 1,
) -> Any:
    """Apply stacked layers in order, checkpointed by `checkpoint`.

    Computes `carry = layers[i](carry)` (or `layers[i](carry, xs[i])` when `xs` is
    given) for `i = 0, ..., D - 1` with a `lax.scan`, so the traced program does not
    grow with the depth.

    **Arguments:**

    - `layers`: `D` layers stacked with a leading depth axis, e.g. by
      [`eqx_remat.stack`][]. Called as `layer(carry)` or `layer(carry, x)`.
      A single layer that was never stacked is caught where the shapes show it:
      when a slice of it returns a carry of the wrong shape (`eqx.nn.Linear`),
      or when every array is one-dimensional with a size that is an axis of the
      carry (`eqx.nn.LayerNorm(4)` on a `(4,)` carry). Otherwise — a layer
      whose every array happens to have the same leading axis, and whose slices
      map the carry to the same shape — it cannot be told from a stack and runs
      as that many layers.
    - `carry`: the input of the first layer (any pytree of arrays); each layer
      returns a value of the same structure, shapes and dtypes.
    - `xs`: optional per-layer inputs with a leading depth axis `D` (dropout keys,
      positions, ...).
    - `checkpoint`: `None` (no checkpointing: every layer's residuals are saved), a
      policy or its name (`jax.checkpoint` on each layer: saves the layer inputs
      plus what the policy saves), or a schedule ([`eqx_remat.every`][],
      [`eqx_remat.nested`][], [`eqx_remat.recursive`][], [`eqx_remat.binomial`][]).
    - `unroll`: layers per iteration of the layer loops (`lax.scan`'s `unroll`):
      an int >= 1 (any integer type), or `True` to unroll the whole stack.
      Larger values trade compile time and program size for step time (fewer
      loop iterations; on TPUs often faster). The gradient does not change.

    **Returns:**

    The output of the last layer.
    """
    depth = _depth(layers, "layers")
    _check_stacked(layers, carry, depth)
    if xs is not None:
        xs_depth = _depth(xs, "xs")
        if xs_depth != depth:
            raise ValueError(
                f"scan_layers expected xs with leading axis {depth} (the depth of "
                f"layers). Got {xs_depth}."
            )
    params, static = eqx.partition(layers, eqx.is_array)

    def step(_, s, c):
        p, x = s
        layer = eqx.combine(p, static)
        out = layer(c) if xs is None else layer(c, x)
        _check_carry(c, out)
        return out

    unroll = _check_unroll(unroll)
    return _apply(step, None, (params, xs), carry, depth, checkpoint, unroll)


def _check_stacked(layers: Any, carry: Any, depth: int) -> None:
    """Catch a single layer passed as if it were stacked, where the shapes say so:
    every array of an `eqx.Module` layer is one-dimensional, so each "layer" would
    hold scalars only, and the supposed depth is an axis of the carry — e.g.
    `eqx.nn.LayerNorm(4)` on a carry of shape `(4,)`. (An unstacked layer whose
    arrays have more dimensions gets a layer of the wrong shapes, which the
    carry check then catches.)"""
    if not isinstance(layers, eqx.Module):
        return
    leaves = jtu.tree_leaves(eqx.filter(layers, eqx.is_array))
    carry_axes = {d for x in jtu.tree_leaves(carry) for d in jnp.shape(x)}
    if all(jnp.ndim(x) == 1 for x in leaves) and depth in carry_axes:
        raise ValueError(
            f"scan_layers expected layers stacked with a leading depth axis (by "
            f"eqx_remat.stack). Got a {type(layers).__name__} whose arrays are all "
            f"one-dimensional of size {depth}, which is also an axis of the carry: "
            "it looks like a single layer that was never stacked. (A stack of "
            "layers holding one scalar each, with as many layers as an axis of "
            "the carry, is indistinguishable from it: give its arrays a trailing "
            "axis of size 1.)"
        )


def _check_carry(before: Any, after: Any) -> None:
    s1, s2 = jtu.tree_structure(before), jtu.tree_structure(after)
    if s1 != s2:
        raise ValueError(
            "Each layer must return a value with the structure of its input carry. "
            f"Got input {s1} and output {s2}."
        )
    for a, b in zip(jtu.tree_leaves(before), jtu.tree_leaves(after)):
        if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            raise ValueError(
                "Each layer must return a carry with the shapes and dtypes of its "
                f"input. Got input {jnp.shape(a)} {jnp.result_type(a)} and output "
                f"{jnp.shape(b)} {jnp.result_type(b)}. (If the layers were never "
                "stacked, each one is a slice of a single layer: build them with "
                "eqx_remat.stack.)"
            )


def chain(fns: Sequence[Callable[[Any], Any]], *, checkpoint: Checkpoint = None):
    """Compose a sequence of callables, applied first to last, checkpointed by
    `checkpoint`.

    `chain([jnp.sin] * 16, checkpoint=recursive())(x)` is `sin` applied 16 times,
    with `O(log 16)` stored carries on the backward pass.

    The callables may differ (they are selected with `lax.switch` inside one
    scan; identical callables share one branch) and may close over arrays,
    including ones being differentiated. Each must map its input to a value of the
    same structure, shapes and dtypes.

    **Arguments:**

    - `fns`: a non-empty sequence of callables of one argument (functions or
      `eqx.Module`s).
    - `checkpoint`: as in [`eqx_remat.scan_layers`][].

    **Returns:**

    A function `x -> fns[-1](...fns[0](x))`.
    """
    fns = list(fns)
    if len(fns) == 0:
        raise ValueError("chain expected at least one function (depth >= 1). Got 0.")
    for i, f in enumerate(fns):
        if not callable(f):
            raise ValueError(f"chain expected callables. Got {f!r} at position {i}.")
    unique: list = []
    index: list[int] = []
    for f in fns:
        for j, u in enumerate(unique):
            if u is f:
                index.append(j)
                break
        else:
            index.append(len(unique))
            unique.append(f)

    def call(x):
        # A module's arrays, and any array a function closes over (tracers
        # included), become explicit arguments of the scan body, so they are
        # differentiated and batched like parameters.
        dynamic, static = eqx.partition(unique, eqx.is_array)
        converted, consts = [], []
        for d, s in zip(dynamic, static):
            f = lambda d, x, s=s: eqx.combine(d, s)(x)
            f, hoisted = jax.closure_convert(f, d, x)
            converted.append(f)
            consts.append((d, hoisted))

        def step(cs, i, c):
            branches = [
                lambda c, j=j: converted[j](cs[j][0], c, *cs[j][1])
                for j in range(len(converted))
            ]
            out = branches[0](c) if len(branches) == 1 else lax.switch(i, branches, c)
            _check_carry(c, out)
            return out

        # The order is needed only to choose between different callables.
        order = jnp.asarray(index, dtype=jnp.int32) if len(unique) > 1 else None
        return _apply(step, tuple(consts), order, x, len(fns), checkpoint)

    return call

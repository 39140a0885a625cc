"""Combinators: stack layers, scan over them, chain callables."""

import contextlib
import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, SupportsIndex, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax

from ._inspect._offload import on_device
from ._policies._apply import checkpointed
from ._schedules._checkpoint import Checkpoint, normalise_checkpoint
from ._schedules._engine import Schedule, remat_scan
from ._schedules._unrolled import run_unrolled, unrolls
from ._util import platform_of
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
        not jnp.issubdtype(jnp.asarray(keys).dtype, jax.dtypes.prng_key)
        and len(shape) < 2
    ):
        raise ValueError(
            "stack expected keys with a leading depth axis, e.g. "
            f"jax.random.split(key, depth). Got keys of shape {shape}."
        )
    if shape[0] == 0:
        raise ValueError("stack expected at least one key (depth >= 1). Got 0 keys.")
    return eqx.filter_vmap(make_layer)(keys)


def stack_depth(stacked: Any, what: str, fn: str = "scan_layers") -> int:
    leaves = jtu.tree_leaves(eqx.filter(stacked, eqx.is_array))
    if not leaves:
        raise ValueError(f"{fn} expected {what} to hold arrays. Got none.")
    depths = {jnp.ndim(x) and x.shape[0] for x in leaves}
    if any(jnp.ndim(x) == 0 for x in leaves):
        raise ValueError(
            f"{fn} expected every array in {what} to have a leading depth "
            "axis. Got a scalar."
        )
    if len(depths) != 1:
        raise ValueError(
            f"{fn} expected every array in {what} to have the same leading "
            f"depth axis. Got depths {sorted(depths)}."
        )
    return depths.pop()


def _leaf_summary(x: Any) -> str:
    if eqx.is_array(x):
        return f"shape {tuple(jnp.shape(x))} {jnp.result_type(x)}"
    return repr(x)


def _same_leaf(a: Any, b: Any) -> bool:
    if eqx.is_array(a) or eqx.is_array(b):
        return (
            eqx.is_array(a)
            and eqx.is_array(b)
            and jnp.shape(a) == jnp.shape(b)
            and jnp.result_type(a) == jnp.result_type(b)
        )
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # e.g. a comparison that returns an array
        return False


def _difference(a: Any, b: Any, path: str) -> str | None:
    """Where and how `a` differs from `b` (the first place met), or `None`."""
    if type(a) is not type(b):
        return f"{path} is a {type(a).__name__}, not a {type(b).__name__}"
    if isinstance(a, eqx.Module):
        for f in dataclasses.fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if f.metadata.get("static", False):
                if not _same_leaf(x, y):
                    return f"{path}.{f.name} (static) is {x!r}, not {y!r}"
            elif (why := _difference(x, y, f"{path}.{f.name}")) is not None:
                return why
        return None
    one_level = lambda node: lambda x: x is not node
    xs, tx = jtu.tree_flatten_with_path(a, is_leaf=one_level(a))
    ys, ty = jtu.tree_flatten_with_path(b, is_leaf=one_level(b))
    if tx != ty:
        return f"{path} has structure {tx}, not {ty}"
    if tx.num_nodes == 1 and tx.num_leaves == 1:  # a leaf
        if _same_leaf(a, b):
            return None
        return f"{path} has {_leaf_summary(a)}, not {_leaf_summary(b)}"
    for (key, x), (_, y) in zip(xs, ys):
        if (why := _difference(x, y, path + jtu.keystr(key))) is not None:
            return why
    return None


def layer_mismatch(layers: Sequence[Any], what: str) -> str | None:
    """Why `layers` cannot be stacked into one, or `None` when they can: the
    first layer that differs from `layers[0]`, and where and how (a type, a
    static field, an array's shape or dtype, a value that is not an array)."""
    for i, layer in enumerate(layers[1:], start=1):
        why = _difference(layer, layers[0], f"{what}[{i}]")
        if why is not None:
            return why + f" as in {what}[0]."
    return None


def check_layers(layers: list, *, fn: str, what: str = "layers") -> None:
    """Check that `layers` are `D >= 1` `eqx.Module`s of one structure.

    **Raises:**

    `ValueError` naming `fn` and `what` for an empty sequence, a layer that is
    not an `eqx.Module`, or layers that differ (the first one that does, and
    how).
    """
    if not layers:
        raise ValueError(
            f"{fn} expected {what} to be a non-empty list or tuple of layers "
            "(depth >= 1). Got an empty one."
        )
    for i, layer in enumerate(layers):
        if not isinstance(layer, eqx.Module):
            raise ValueError(
                f"{fn} expected {what} to be a list or tuple of eqx.Modules of "
                f"one structure. Got {type(layer).__name__} at {what}[{i}]."
            )
    why = layer_mismatch(layers, what)
    if why is not None:
        raise ValueError(
            f"{fn} expected {what} to be layers of one structure (the same "
            "type, static fields, array shapes and dtypes), to stack them. " + why
        )


def stack_layers(layers: Sequence[_T], *, fn: str, what: str = "layers") -> _T:
    """A list or tuple of `D` layers of one structure (`check_layers`) as one
    layer whose arrays have a leading depth axis: each array leaf is
    `jnp.stack` of the layers' leaves; the rest is `layers[0]`'s. This copies
    the parameters (inside a `jax.jit`, on every call)."""
    layers = list(layers)
    check_layers(layers, fn=fn, what=what)
    return _stack(layers)


def _stack(layers: list[_T]) -> _T:
    """`stack_layers` of layers already checked."""
    dynamic = [eqx.filter(layer, eqx.is_array) for layer in layers]
    stacked = jtu.tree_map(lambda *xs: jnp.stack(xs), *dynamic)
    return eqx.combine(stacked, eqx.filter(layers[0], eqx.is_array, inverse=True))


def _apply(
    step: Callable[[Any, Any], Any],
    stacked: Any,
    carry: Any,
    depth: int,
    checkpoint: Checkpoint,
    unroll: int | bool = 1,
) -> Any:
    """`for i in range(depth): carry = step(stacked[i], carry)`;
    `unroll` already normalised by the caller (`check_unroll`)."""
    if depth < 1:
        raise ValueError(f"Expected a depth >= 1 (at least one layer). Got {depth}.")
    checkpoint = normalise_checkpoint(checkpoint)
    if isinstance(checkpoint, Schedule):
        layer = lambda _, s, c: step(s, c)
        return remat_scan(layer, None, stacked, carry, depth, checkpoint, unroll)
    body = lambda c, s: (step(s, c), None)
    if checkpoint is not None:
        body = checkpointed(body, on_device(checkpoint))
    return lax.scan(body, carry, stacked, length=depth, unroll=unroll)[0]


def check_unroll(unroll: Any) -> int | bool:
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
      [`eqx_remat.stack`][] or held by an [`eqx_remat.Stacked`][]; or a list or
      tuple of `D` `eqx.Module`s of one structure (the same type, static fields,
      array shapes and dtypes: `[Block(k) for k in keys]`; layers that differ
      are a `ValueError` naming the first that does, and how). A list is
      checkpointed where its layers are, traced layer by layer as a Python
      loop over it is (`Schedule.unrolled`: `jax.checkpoint` per layer for a
      policy, nested over segments for a schedule), so that no layer is
      copied. Two exceptions stack the list (`jnp.stack` of each array, on
      every call) and scan it, with an [`eqx_remat.StackedListWarning`][]:
      a checkpointed list on the CPU of jaxlib 0.10, where XLA runs
      checkpoints in straight-line code as none (in a loop, they act; jaxlib
      0.11's CPU keeps them), and a schedule of your own without `unrolled`.
      Stacking copies the parameters, and the gradient is stacked too
      before it is split per layer: up to twice the layers' parameters in
      temporary memory, which dominates for wide layers on a small batch.
      Holding the layers stacked
      (`eqx_remat.Stacked([...])`, built once) avoids both, and traces one
      layer whatever `D`.
      Each layer is called as `layer(carry)` or `layer(carry, x)`, and may
      close over arrays, including ones being differentiated or batched.
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
      A list run in place is unrolled already.

    **Returns:**

    The output of the last layer.
    """
    if isinstance(layers, (list, tuple)):
        check_unroll(unroll)
        layers = list(layers)
        check_layers(layers, fn="scan_layers")
        if _in_place(layers, carry, checkpoint, "scan_layers", "layers"):
            return _scan_list(layers, carry, xs, checkpoint)
        layers = _stack(layers)
        return scan_stacked(layers, carry, xs, checkpoint=checkpoint, unroll=unroll)
    _check_stacked(layers, carry, stack_depth(layers, "layers"))
    return scan_stacked(layers, carry, xs, checkpoint=checkpoint, unroll=unroll)


class StackedListWarning(UserWarning):
    """Warned by [`eqx_remat.scan_layers`][] and [`eqx_remat.chain`][] when a
    list of layers is stacked (a copy of their parameters, and of their
    gradient, in every step) because it cannot be checkpointed in place: on
    the CPU of jaxlib 0.10, where XLA runs a checkpoint in straight-line code
    as none, or for a schedule of your own without `Schedule.unrolled`. The
    fix is to hold the layers stacked, in an [`eqx_remat.Stacked`][]; to
    accept the copy, silence it:
    `warnings.simplefilter("ignore", eqx_remat.StackedListWarning)`."""


_STACK_LISTS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "eqx_remat_stack_lists", default=False
)


@contextlib.contextmanager
def stacking_lists() -> Iterator[None]:
    """Within: lists of layers are stacked and scanned, as a stack is.
    [`eqx_remat.plan`][] prices a checkpoint by what a scan over a stack
    saves, so it traces a list of layers this way (and then compiles the
    program as it runs: the list in place)."""
    token = _STACK_LISTS.set(True)
    try:
        yield
    finally:
        _STACK_LISTS.reset(token)


def cpu_keeps_checkpoints() -> bool:
    """Whether XLA's CPU compiler keeps a checkpoint in straight-line code.

    jaxlib 0.10.2's runs a `jax.checkpoint` outside a loop as none: eight
    layers checkpointed one by one compile to the temp memory of no
    checkpoint (in a loop, checkpoints act). jaxlib 0.11.2's keeps it: the
    same eight layers need 44% less. `tests/test_combinators.py` holds this
    rule against the compiler it runs on; versions between were not tried."""
    return jax.__version_info__ >= (0, 11)


def _in_place(
    layers: Sequence, carry: Any, checkpoint: Checkpoint, fn: str, what: str
) -> bool:
    """Whether a list of layers (checked to be of one structure, so that a
    list runs wherever its stack would) runs in place (`Schedule.unrolled`),
    or is stacked and scanned.

    In place, unless: `plan` is pricing (`stacking_lists`); or the program is
    for the CPU and checkpointed, where XLA may run a checkpoint in a list as no
    checkpoint (`cpu_keeps_checkpoints`); or the checkpoint is a schedule of
    the user's own without `unrolled`. The last two warn, with what stacking
    costs and the fix."""
    c = normalise_checkpoint(checkpoint)
    if _STACK_LISTS.get():
        return False
    if c is None:
        return True
    leaves = jtu.tree_leaves(carry)
    platform = platform_of(leaves[0]) if leaves else jax.default_backend()
    drops = platform == "cpu" and not cpu_keeps_checkpoints()
    if not drops and unrolls(c):
        return True
    why = (
        f"on the {platform}, XLA runs a checkpoint on a list of layers as none"
        if drops
        else f"{checkpoint!r} has no `unrolled` method"
    )
    warnings.warn(
        f"{fn}: {why}, so the list of {len(layers)} layers is stacked and "
        "scanned: a copy of their parameters, and of their gradient, in every "
        f"step. Hold them stacked: eqx_remat.Stacked({what}).",
        StackedListWarning,
        stacklevel=3,
    )
    return False


def _scan_list(layers: Sequence, carry: Any, xs: Any, checkpoint: Checkpoint) -> Any:
    """`scan_layers` of a list of layers, each layer where it is."""
    carry = jtu.tree_map(jnp.asarray, carry)  # Python scalars have no shape
    if xs is not None:
        xs_depth = stack_depth(xs, "xs")
        if xs_depth != len(layers):
            raise ValueError(
                f"scan_layers expected xs with leading axis {len(layers)} (the "
                f"number of layers). Got {xs_depth}."
            )

    def call(i: int, c: Any) -> Any:
        x = None if xs is None else jtu.tree_map(lambda a: a[i], xs)
        out = layers[i](c) if xs is None else layers[i](c, x)
        _check_carry(c, out)
        return out

    fns = [functools.partial(call, i) for i in range(len(layers))]
    return run_unrolled(fns, carry, checkpoint)


def scan_stacked(
    layers: Any,
    carry: Any,
    xs: Any = None,
    *,
    checkpoint: Checkpoint = None,
    unroll: SupportsIndex | bool = 1,
) -> Any:
    """[`eqx_remat.scan_layers`][] for layers known to be stacked (by
    `stack_layers`, [`eqx_remat.stack`][], an [`eqx_remat.Stacked`][]): without
    the check for a single layer passed as a stack, which a stack of layers
    holding one scalar each could otherwise fail."""
    depth = stack_depth(layers, "layers")
    if xs is not None:
        xs_depth = stack_depth(xs, "xs")
        if xs_depth != depth:
            raise ValueError(
                f"scan_layers expected xs with leading axis {depth} (the depth of "
                f"layers). Got {xs_depth}."
            )
    params, static = eqx.partition(layers, eqx.is_array)

    def step(s, c):
        p, x = s
        layer = eqx.combine(p, static)
        out = layer(c) if xs is None else layer(c, x)
        _check_carry(c, out)
        return out

    unroll = check_unroll(unroll)
    return _apply(step, (params, xs), carry, depth, checkpoint, unroll)


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

    `eqx.Module`s of one structure (the same type, static fields, array shapes
    and dtypes: `[Block(k) for k in keys]`) are a list of layers, run as
    [`eqx_remat.scan_layers`][] runs one: in place, or stacked with an
    [`eqx_remat.StackedListWarning`][] where they cannot be. Other callables
    may differ (they are selected with `lax.switch` inside one scan, which
    compiles and keeps every branch; identical callables share one branch).
    Callables may close over arrays, including ones being differentiated.
    Each must map its input to a value of the same structure, shapes and
    dtypes.

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
    if (
        len(unique) > 1
        and all(isinstance(f, eqx.Module) for f in unique)
        and layer_mismatch(fns, "fns") is None
    ):
        return lambda x: _chain_modules(fns, x, checkpoint)
    return lambda x: _chain_switch(unique, index, x, checkpoint)


def _chain_modules(fns: list, x: Any, checkpoint: Checkpoint) -> Any:
    """Modules of one structure (`chain` checked them): each where it is (see
    `scan_layers`), or one stack, one traced layer, no switch."""
    if _in_place(fns, x, checkpoint, "chain", "fns"):
        return _scan_list(fns, x, None, checkpoint)
    return scan_stacked(_stack(fns), x, checkpoint=checkpoint)


def _chain_switch(unique: list, index: list[int], x: Any, checkpoint) -> Any:
    """Different callables: one branch each, chosen by `lax.switch`."""

    def step(i, c):
        # Fresh branches: `lax.switch` caches a branch's trace by its identity,
        # and a callable may read a value that has changed since.
        branches = [lambda c, f=f: f(c) for f in unique]
        out = branches[0](c) if len(branches) == 1 else lax.switch(i, branches, c)
        _check_carry(c, out)
        return out

    # The order is needed only to choose between different callables.
    order = jnp.asarray(index, dtype=jnp.int32) if len(unique) > 1 else None
    return _apply(step, order, x, len(index), checkpoint)

"""Micro-batches (gradient accumulation): `accumulate` splits the batch axis of a
gradient function's arguments into `k` micro-batches and sums or averages what
each returns, with one `lax.scan`.

The split is strided: micro-batch `j` holds examples `j, j + k, j + 2k, ...`. A
batch axis of size `B` sharded over `n` devices in contiguous blocks (data
parallelism, `zoo.shard_batch`) is reshaped to `(B / k, k)`, still sharded
over its first axis, and the scan runs over the second: every device keeps its
own examples, and no micro-batch is moved between devices (where `k` divides
each device's share `B / n`). A contiguous split, `(k, B / k)`, would put each
micro-batch on `n / k` of the devices and reshard the batch at every step.
"""

from collections.abc import Callable
from typing import Any, Literal, SupportsIndex

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import PyTree

from ._validate import check_int


Reduce = Literal["mean", "sum"]

_FN = "eqx_remat.accumulate"


def accumulate(
    grad_fn: Callable[..., Any],
    micro_batches: SupportsIndex,
    *,
    in_axes: Any = (None, 0),
    reduce: Reduce = "mean",
) -> Callable[..., Any]:
    """Gradient accumulation: run `grad_fn` on `micro_batches` slices of the batch,
    one after another in a `lax.scan`, and combine what they return.

    The activations of one micro-batch are alive at a time, so a step needs about
    `1 / micro_batches` of the activation memory of the whole batch (plus one
    accumulator per output: the gradients' size), at the same FLOPs.

    ```python
    grad_fn = eqx.filter_value_and_grad(loss_fn)           # loss_fn(model, batch)
    step = eqx_remat.accumulate(grad_fn, micro_batches=4)  # split batch's axis 0
    loss, grads = step(model, batch)  # == grad_fn(model, batch), 1/4 of the memory
    ```

    **Arguments:**

    - `grad_fn`: the function to accumulate, typically a `jax.value_and_grad` or
      `eqx.filter_value_and_grad` of a loss (with `has_aux=True` or not). It may
      return any pytree: every array in it (loss, gradients, auxiliary output) is
      combined by `reduce`; other leaves (`None`, Python values) are returned as
      the first micro-batch's trace returned them.
    - `micro_batches`: the number `k >= 1` of micro-batches; it must divide the
      batch size. `1` calls `grad_fn` as it is.
    - `in_axes`: where the batch axis of each positional argument is, as in
      `jax.vmap`: a tuple with one entry per positional argument (or one entry
      for all), each an `int` (the batch axis of every array in that argument),
      `None` (not split: parameters, a shared key) or a pytree prefix of the
      argument made of those. Default `(None, 0)`: `grad_fn(model, batch)`, the
      batch split along its leading axis. Non-array leaves are never split, and
      keyword arguments are passed to every micro-batch as they are. (Keyword
      only.)
    - `reduce`: how the micro-batches' outputs are combined. `"mean"` (default):
      their mean, which equals the whole batch's output when the loss is a mean
      over the examples of its batch (each micro-batch has `B / k` of them);
      `"sum"`: their sum, for a loss summed over the examples. Integer outputs
      (counts) are summed under both. Floating outputs are accumulated in at
      least float32 and returned in their own dtype. A mean over tokens whose
      count differs between micro-batches (padding masks) is not the mean over
      the batch: return sums (and counts) and divide afterwards. (Keyword only.)

    **Returns:**

    A function with `grad_fn`'s signature and output structure.

    Micro-batch `j` holds the examples `j, j + k, j + 2k, ...` of the batch: the
    batch axis is reshaped to `(B / k, k)` and the scan runs over the second axis,
    so a batch sharded over devices along its batch axis (data parallelism, FSDP)
    stays where it is: each device computes on its own examples at every step,
    and no micro-batch is resharded, provided `k` divides each device's share.
    Works under `jax.jit` and `jax.vmap`.

    **Raises:**

    `ValueError` (naming the argument) when `micro_batches` is not an int >= 1,
    `reduce` is not one of its choices, `in_axes` does not match the arguments,
    the split arrays disagree on the batch size, or `micro_batches` does not
    divide it.
    """
    k = check_int(_FN, "micro_batches", micro_batches, 1)
    if reduce not in ("mean", "sum"):
        raise ValueError(
            f"{_FN}: reduce must be one of ['mean', 'sum']. Got {reduce!r}."
        )

    # Flattened, so that a dict prefix is hashable as a static field.
    leaves, treedef = jtu.tree_flatten(in_axes, is_leaf=lambda a: a is None)
    return _Accumulated(grad_fn, k, (tuple(leaves), treedef), reduce)


class _Accumulated(eqx.Module):
    """What [`eqx_remat.accumulate`][] returns: a module (so a pytree, like the
    wrappers of `eqx.filter_jit` and `eqx.filter_vmap`) that calls `grad_fn` once
    per micro-batch."""

    grad_fn: Callable[..., Any]
    micro_batches: int = eqx.field(static=True)
    in_axes: tuple[tuple[Any, ...], Any] = eqx.field(static=True)
    reduce: Reduce = eqx.field(static=True)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self.grad_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        k, grad_fn = self.micro_batches, self.grad_fn
        if k == 1:
            return grad_fn(*args, **kwargs)
        leaves, treedef = self.in_axes
        axes = _broadcast_axes(jtu.tree_unflatten(treedef, leaves), args)
        xs, rest = _split(args, axes, k)

        def run(micro: tuple) -> Any:
            return grad_fn(*_unsplit(eqx.combine(micro, rest), axes, args), **kwargs)

        first = jtu.tree_map(lambda x: x[0], xs)
        shapes = eqx.filter_eval_shape(run, first)
        dynamic_shapes, static = eqx.partition(
            shapes, lambda x: isinstance(x, jax.ShapeDtypeStruct)
        )

        def body(total: PyTree, micro: tuple) -> tuple[PyTree, None]:
            out = eqx.filter(run(micro), eqx.is_array)
            return jtu.tree_map(lambda t, o: t + o.astype(t.dtype), total, out), None

        init = jtu.tree_map(_zeros, dynamic_shapes)
        total, _ = lax.scan(body, init, xs)
        out = jtu.tree_map(
            lambda t, s: _finish(t, s, k, self.reduce), total, dynamic_shapes
        )
        return eqx.combine(out, static)


def check_split(args: tuple, micro_batches: int, in_axes: Any) -> None:
    """Raise what `accumulate(grad_fn, micro_batches, in_axes=in_axes)(*args)`
    would raise for the split of `args` (their shapes only: nothing runs)."""
    axes = _broadcast_axes(in_axes, args)
    eqx.filter_eval_shape(lambda a: _split(a, axes, micro_batches), args)


def _broadcast_axes(in_axes: Any, args: tuple) -> tuple:
    """`in_axes` as one full pytree of `int | None` per argument (to its array
    leaves)."""
    if not isinstance(in_axes, tuple):
        in_axes = (in_axes,) * len(args)
    if len(in_axes) != len(args):
        raise ValueError(
            f"{_FN}: in_axes must have one entry per positional argument. Got "
            f"in_axes={in_axes!r} ({len(in_axes)} entries) for {len(args)} "
            "arguments; pass in_axes=... (e.g. (None, 0) for grad_fn(model, batch))."
        )
    out = []
    for i, (axis, arg) in enumerate(zip(in_axes, args)):
        try:
            full = jtu.tree_map(
                lambda a, x: jtu.tree_map(lambda _: a, x),
                axis,
                arg,
                is_leaf=lambda a: a is None or isinstance(a, int),
            )
        except ValueError as e:
            raise ValueError(
                f"{_FN}: in_axes[{i}] must be an int, None or a pytree prefix of "
                f"argument {i}. Got {axis!r}: {e}"
            ) from None
        leaves = jtu.tree_leaves(full)  # None (not split) is no leaf
        if any(isinstance(a, bool) or not isinstance(a, int) for a in leaves):
            raise ValueError(
                f"{_FN}: in_axes[{i}] must be an int, None or a pytree prefix of "
                f"argument {i} holding ints and None. Got {axis!r}."
            )
        out.append(full)
    return tuple(out)


def _split(args: tuple, axes: tuple, k: int) -> tuple[PyTree, PyTree]:
    """`(xs, rest)`: `xs` has each array to split as `(k, B / k, ...)`, its batch
    axis moved to the front and split strided (micro-batch `j` holds examples
    `j, j + k, ...`), and `None` elsewhere; `rest` has the other leaves, and
    `None` in place of the split arrays."""
    sizes: dict[int, str] = {}

    def split(path, axis, x):
        where = f"args{jtu.keystr(path)}"
        if not -x.ndim <= axis < x.ndim:
            raise ValueError(
                f"{_FN}: in_axes gives axis {axis} for the array of shape "
                f"{x.shape} at {where}, which has {x.ndim} axes."
            )
        x = jnp.moveaxis(x, axis, 0)
        size = x.shape[0]
        sizes.setdefault(size, where)
        if len(sizes) > 1:
            (a, wa), (b, wb) = list(sizes.items())[:2]
            raise ValueError(
                f"{_FN}: every array split by in_axes must have the same batch "
                f"size. Got {a} at {wa} and {b} at {wb}."
            )
        if size % k != 0:
            raise ValueError(
                f"{_FN}: micro_batches={k} must divide the batch size. Got a batch "
                f"of {size} (axis {axis} of shape {x.shape} at {where})."
            )
        x = x.reshape((size // k, k) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    out = jtu.tree_map_with_path(
        lambda p, a, x: _Split(split(p, a, x)) if _splits(a, x) else x,
        axes,
        args,
        is_leaf=lambda a: a is None,
    )
    if not sizes:
        raise ValueError(
            f"{_FN}: in_axes={_short(axes)} splits no array: name the batch axis "
            "of at least one argument, e.g. in_axes=(None, 0)."
        )
    is_split = lambda x: isinstance(x, _Split)
    xs = jtu.tree_map(lambda x: x.value if is_split(x) else None, out, is_leaf=is_split)
    rest = jtu.tree_map(lambda x: None if is_split(x) else x, out, is_leaf=is_split)
    return xs, rest


class _Split(eqx.Module):
    value: jax.Array


def _splits(axis: int | None, x: Any) -> bool:
    return axis is not None and eqx.is_array(x)


def _unsplit(micro: tuple, axes: tuple, args: tuple) -> tuple:
    """One micro-batch's arguments: each split array, `(B / k, ...)`, with its
    batch axis put back where `in_axes` says."""
    return jtu.tree_map(
        lambda a, x, m: jnp.moveaxis(m, 0, a % x.ndim) if _splits(a, x) else m,
        axes,
        args,
        micro,
        is_leaf=lambda a: a is None,
    )


def _acc_dtype(dtype: Any) -> Any:
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact) and dtype.itemsize < 4:
        return jnp.dtype(jnp.float32)
    if dtype == jnp.bool_:
        return jnp.dtype(jnp.int32)
    return dtype


def _zeros(shape: jax.ShapeDtypeStruct) -> jax.Array:
    sharding = getattr(shape, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    explicit = mesh is not None and any(
        t == jax.sharding.AxisType.Explicit for t in mesh.axis_types
    )
    dtype = _acc_dtype(shape.dtype)
    if explicit:
        return jnp.zeros(shape.shape, dtype, out_sharding=sharding)
    return jnp.zeros(shape.shape, dtype)


def _finish(total: jax.Array, shape: jax.ShapeDtypeStruct, k: int, reduce: Reduce):
    if reduce == "mean" and jnp.issubdtype(total.dtype, jnp.inexact):
        total = total / jnp.asarray(k, total.dtype)
    return lax.convert_element_type(total, shape.dtype)


def _short(axes: tuple) -> str:
    return repr(jtu.tree_map(lambda a: a, axes, is_leaf=lambda a: a is None))

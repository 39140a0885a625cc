"""Data parallelism and FSDP over a `jax.sharding.Mesh`: where each array lives,
and the mesh helpers of the models (which mesh an array is on, gathering
weights sharded over Explicit axes)."""

import math
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.core
import jax.tree_util as jtu
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, ArrayLike, PyTree

from eqx_remat.internal import is_array_like


_T = TypeVar("_T")


Axes = str | tuple[str, ...]
"""One mesh axis, or several taken together (their devices multiplied)."""


def _axis_size(fn: str, mesh: Mesh, axis: Axes) -> int:
    """How many devices `axis` spans: the product of its axes' sizes."""
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    for name in names or (None,):
        if name not in mesh.axis_names:
            raise ValueError(
                f"{fn}: expected a mesh with an axis named {name!r} (axis="
                f"{axis!r}). Got a mesh with axes {tuple(mesh.axis_names)}; pass "
                "axis=... to choose one, or a tuple of them."
            )
    return math.prod(mesh.shape[name] for name in names)


def _explicit(mesh: Mesh | AbstractMesh) -> bool:
    return any(t == AxisType.Explicit for t in mesh.axis_types)


def _explicit_mesh(x: ArrayLike) -> Mesh | AbstractMesh | None:
    """The mesh of `x`'s type if it has Explicit axes (sharding in types), else
    `None`."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return mesh if mesh is not None and _explicit(mesh) else None


def _gathered(tree: _T) -> _T:
    """`tree` with every array on a mesh of more than one device gathered to
    replicated: what FSDP does with a layer's weights before using them. On
    Explicit mesh axes the array is resharded (its type changes); on Auto axes
    it is constrained to be replicated. Without that constraint XLA's sharding
    propagation may keep the weights split and gather the activations over the
    batch instead: the MLP of a Llama block (d_model 4096, MLP 28672) on 256 TPU
    v5e chips gathered the whole batch's layer inputs, 24 GiB a chip. Off a
    mesh, and on Auto axes of one device or outside `jax.jit`, and on Manual
    axes (inside `jax.shard_map`), arrays are returned unchanged."""

    def gather(x):
        if not eqx.is_array(x):
            return x
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or not mesh.axis_names:
            return x
        replicated = NamedSharding(mesh, PartitionSpec())
        if _explicit(mesh):
            if all(p is None for p in getattr(sharding, "spec", ())):
                return x
            return jax.sharding.reshard(x, replicated)
        auto = all(t == AxisType.Auto for t in mesh.axis_types)
        if auto and math.prod(mesh.axis_sizes) > 1 and isinstance(x, jax.core.Tracer):
            return jax.lax.with_sharding_constraint(x, replicated)
        return x  # one device, outside `jax.jit`, or Manual axes (`jax.shard_map`)

    return jax.tree.map(gather, tree)


def _embed(table: Array, tokens: Array) -> Array:
    """`table[tokens]`. Under a mesh with Explicit axes the gather must be told
    where its output lives: like the tokens, each row whole."""
    mesh = _explicit_mesh(tokens)
    if mesh is None:
        return table[tokens]
    spec = jax.typeof(tokens).sharding.spec
    out = NamedSharding(mesh, PartitionSpec(*spec, None))
    return table.at[tokens].get(out_sharding=out)


def _mesh_of(x: Array) -> Mesh | AbstractMesh | None:
    """The (abstract) mesh `x` is sharded on: from its type, else the mesh set with
    `jax.set_mesh`; `None` if neither has axes."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not mesh.axis_names:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or not mesh.axis_names or math.prod(mesh.axis_sizes) == 1:
        return None
    return mesh


def _fsdp_dim(shape: tuple[int, ...], n: int) -> int | None:
    """The largest axis of `shape` divisible by `n` (the first among equals), or
    `None` if there is none."""
    best = None
    for i, size in enumerate(shape):
        if size % n == 0 and (best is None or size > shape[best]):
            best = i
    return best


def _place(x: Any, sharding: NamedSharding) -> Any:
    """`x` with `sharding`: an abstract array gets it as its `.sharding`, a traced
    array is constrained to it, a concrete array is moved."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(x, jax.core.Tracer):
        if _explicit(sharding.mesh):
            # Sharding in types: the array's type changes, with a reshard.
            return jax.sharding.reshard(x, sharding)
        return jax.lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)


def _shardings(
    tree: PyTree, mesh: Mesh, *, fsdp: bool = False, axis: Axes = "data"
) -> PyTree:
    """The shardings that [`zoo.shard`][] gives the arrays of `tree`.

    Useful where the placement must be named rather than done: `in_shardings` and
    `out_shardings` of `jax.jit`, or `jax.ShapeDtypeStruct`s for ahead-of-time
    compilation.

    **Arguments:**

    - `tree`: any pytree (a model, an optimiser state, ...). Its array leaves
      (`eqx.is_array`, and `jax.ShapeDtypeStruct`) get a sharding.
    - `mesh`: the device mesh.
    - `fsdp`: `False` (data parallel): every array is replicated. `True` (fully
      sharded data parallel): every array is split along its largest axis whose
      size is divisible by the number of devices on mesh axis `axis` (the first
      such axis among equally large ones), and replicated if it has none.
      (Keyword only.)
    - `axis`: the name of the mesh axis that the parameters are split over
      with `fsdp=True`, or a tuple of names (split over all of them together).
      Default `"data"`. (Keyword only.)

    **Returns:**

    A pytree with the structure of `tree`: a `jax.sharding.NamedSharding` in place
    of every array, and the other leaves unchanged.
    """
    n = _axis_size("zoo.shard", mesh, axis)
    axis = axis if isinstance(axis, str) else tuple(axis)

    def leaf_sharding(x):
        if not is_array_like(x):
            return x
        spec: list[Axes | None] = [None] * len(x.shape)
        dim = _fsdp_dim(tuple(x.shape), n) if fsdp else None
        if dim is not None:
            spec[dim] = axis
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jtu.tree_map(leaf_sharding, tree, is_leaf=is_array_like)


def shard(
    tree: PyTree, mesh: Mesh, *, fsdp: bool = False, axis: Axes = "data"
) -> PyTree:
    """Place the parameters (or optimiser state) `tree` on `mesh`: replicated for
    data parallelism, or split for FSDP.

    The placement of an array depends only on its shape, so an optimiser state
    whose moments have the parameters' shapes (Adam's) is split like the
    parameters: `zoo.shard(opt_state, mesh, fsdp=True)` matches
    `zoo.shard(model, mesh, fsdp=True)`.

    Works both outside `jax.jit` (the arrays are moved with `jax.device_put`) and
    inside it (the arrays are constrained with `jax.lax.with_sharding_constraint`,
    e.g. to keep an updated model on its sharding). A `jax.ShapeDtypeStruct`
    leaf is returned with the sharding attached, nothing is allocated.

    !!! Example

        ```python
        mesh = jax.make_mesh(
            (jax.device_count(),), ("data",), axis_types=(AxisType.Auto,)
        )
        model = zoo.shard(model, mesh, fsdp=True)
        tokens = zoo.shard_batch(tokens, mesh)
        grads = eqx.filter_jit(eqx.filter_grad(loss))(model, tokens)
        ```

    **Arguments:**

    - `tree`: any pytree; its array leaves are placed and the other leaves (static
      fields, activation functions, ...) are kept as they are.
    - `mesh`: the device mesh, with axes of type `jax.sharding.AxisType.Auto`
      (the compiler propagates the sharding of intermediates; what
      `jax.sharding.Mesh` builds by default) or `AxisType.Explicit` (the
      sharding is part of every array's type; what `jax.make_mesh` builds by
      default). Inside `jax.jit`, arrays are constrained with
      `jax.lax.with_sharding_constraint` on Auto meshes and resharded with
      `jax.sharding.reshard` on Explicit ones.
    - `fsdp`: `False` (data parallel): every array is replicated on every device.
      `True` (fully sharded data parallel, ZeRO-3): every array is split along its
      largest axis whose size is divisible by the number of devices on mesh axis
      `axis`, and replicated if no axis is. (Keyword only.)
    - `axis`: the name of the mesh axis that, with `fsdp=True`, the
      parameters are split over, or a tuple of names (split over all of them
      together). Default `"data"`. On a mesh of several axes the batch may be
      split over more of them than the parameters: data parallelism over
      `"data"` and FSDP over `"fsdp"` is
      `zoo.shard(model, mesh, fsdp=True, axis="fsdp")` with
      `zoo.shard_batch(tokens, mesh, axis=("data", "fsdp"))`. (Keyword only.)

    **Returns:**

    A copy of `tree` with every array placed. (For `jax.jit`'s `in_shardings`,
    read them back: `jax.tree.map(lambda x: x.sharding, zoo.shard(...))`, also
    on `jax.ShapeDtypeStruct`s.)
    """
    specs = _shardings(tree, mesh, fsdp=fsdp, axis=axis)
    return jtu.tree_map(
        lambda x, s: _place(x, s) if is_array_like(x) else x,
        tree,
        specs,
        is_leaf=is_array_like,
    )


def shard_batch(batch: PyTree, mesh: Mesh, *, axis: Axes = "data") -> PyTree:
    """Split a batch across the devices of `mesh` along its leading (batch) axis.

    Works outside `jax.jit` (`jax.device_put`) and inside it
    (`jax.lax.with_sharding_constraint`); a `jax.ShapeDtypeStruct` leaf is returned
    with the sharding attached.

    **Arguments:**

    - `batch`: a pytree whose array leaves all have a leading batch axis, e.g.
      `tokens` of shape `(batch, seq)`, or `(tokens, keys)`. Non-array leaves are
      kept as they are.
    - `mesh`: the device mesh, Auto or Explicit axes (see [`zoo.shard`][]).
    - `axis`: the name of the mesh axis to split the batch over, or a tuple
      of names (split over all of them together, e.g. `("data", "fsdp")`).
      Default `"data"`. (Keyword only.)

    **Returns:**

    A copy of `batch`, each array split along its first axis over mesh axis
    `axis` (and replicated over the mesh's other axes).

    **Raises:**

    `ValueError` if an array has no leading axis, or one whose size is not
    divisible by the number of devices on `axis` (the message names the leaf), or
    if `mesh` has no axis `axis`.
    """
    n = _axis_size("zoo.shard_batch", mesh, axis)
    axis = axis if isinstance(axis, str) else tuple(axis)

    def place(path, x):
        if not is_array_like(x):
            return x
        if len(x.shape) == 0 or x.shape[0] % n != 0:
            raise ValueError(
                "zoo.shard_batch: expected every array to have a leading batch axis "
                f"divisible by the {n} devices of mesh axis {axis!r}. Got shape "
                f"{tuple(x.shape)} at batch{jtu.keystr(path)}."
            )
        spec = PartitionSpec(axis, *[None] * (len(x.shape) - 1))
        return _place(x, NamedSharding(mesh, spec))

    return jtu.tree_map_with_path(place, batch, is_leaf=is_array_like)

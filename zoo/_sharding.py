"""Data parallelism, FSDP and tensor parallelism over a `jax.sharding.Mesh`:
where each array lives, and the mesh helpers of the models (which mesh an array
is on, gathering a layer's weights)."""

import math
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.core
import jax.tree_util as jtu
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, ArrayLike, PyTree

from eqx_remat.internal import TENSOR_AXIS, is_array_like

from ._layers import Dense


_T = TypeVar("_T")


Axes = str | tuple[str, ...]
"""One mesh axis, or several taken together (their devices multiplied)."""

# The mesh axis that tensor parallelism splits each `Dense` with `parallel` over
# (MaxText's `ici_tensor_parallelism`): the one eqx_remat's planner counts.
TENSOR = TENSOR_AXIS


def _tensor_size(mesh: Mesh | AbstractMesh | None) -> int:
    """The devices of `mesh`'s tensor axis (1: it has none)."""
    return 1 if mesh is None else dict(mesh.shape).get(TENSOR, 1)


def _tensor_dims(m: Dense) -> tuple[int | None, int | None]:
    """The axes of `m`'s weight and bias that tensor parallelism splits."""
    if m.parallel == "columns":
        return -1, -1
    return (-2, None) if m.parallel == "rows" else (None, None)


def _map_dense(f: Any, tree: _T) -> _T:
    """`tree` with `f(x, dim)` for each array `x`: `dim` the axis tensor
    parallelism splits (a `Dense`'s), else `None`."""

    def each(m):
        if not isinstance(m, Dense):
            return f(m, None)
        weight, bias = _tensor_dims(m)
        m = eqx.tree_at(lambda d: d.weight, m, f(m.weight, weight))
        if m.bias is not None:
            m = eqx.tree_at(lambda d: d.bias, m, f(m.bias, bias))
        return m

    return jax.tree.map(each, tree, is_leaf=lambda m: isinstance(m, Dense))


def _check_tensor(weight: Array, **sizes: int) -> None:
    """Under tensor parallelism (`weight`'s mesh has a tensor axis), raise a
    `ValueError` naming the first of `sizes` (a model's) that its devices do
    not divide, or the mesh's Explicit axes."""
    mesh = _mesh_of(weight)
    n = _tensor_size(mesh)
    if n > 1 and mesh is not None and _explicit(mesh):
        raise ValueError(
            f"zoo.Transformer: tensor parallelism over the mesh axis {TENSOR!r} "
            "needs a mesh of Auto axes (jax.sharding.AxisType.Auto). Got a mesh "
            f"with axis types {tuple(mesh.axis_types)}."
        )
    for name, size in sizes.items():
        if n > 1 and size % n:
            raise ValueError(
                f"zoo.Transformer: tensor parallelism over the mesh axis "
                f"{TENSOR!r} ({n} devices) splits the attention by key/value "
                f"heads and the MLP by its hidden units: expected {name} divisible "
                f"by {n}. Got {name}={size}."
            )


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
    replicated, but for the axis tensor parallelism splits (a `Dense` with
    `parallel`, on a mesh with a tensor axis), which stays split over it: what
    FSDP does with a layer's weights before using them. On Explicit mesh axes
    the array is resharded (its type changes); on Auto axes it is constrained.
    Without that constraint XLA's sharding propagation may keep the weights
    split and gather the activations over the batch instead: the MLP of a
    Llama block (d_model 4096, MLP 28672) on 256 TPU v5e chips gathered the
    whole batch's layer inputs, 24 GiB a chip. Off a mesh, and on Auto axes of
    one device or outside `jax.jit`, and on Manual axes (inside
    `jax.shard_map`), arrays are returned unchanged."""

    def gather(x, dim):
        if not eqx.is_array(x):
            return x
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or not mesh.axis_names:
            return x
        spec: list[str | None] = [None] * x.ndim
        if dim is not None and _tensor_size(mesh) > 1:
            spec[dim] = TENSOR
        kept = NamedSharding(mesh, PartitionSpec(*spec))
        if _explicit(mesh):
            have = tuple(getattr(sharding, "spec", ()))
            if have + (None,) * (x.ndim - len(have)) == tuple(spec):
                return x
            return jax.sharding.reshard(x, kept)
        auto = all(t == AxisType.Auto for t in mesh.axis_types)
        if auto and math.prod(mesh.axis_sizes) > 1 and isinstance(x, jax.core.Tracer):
            return jax.lax.with_sharding_constraint(x, kept)
        return x  # one device, outside `jax.jit`, or Manual axes (`jax.shard_map`)

    return _map_dense(gather, tree)


def _split_features(x: Array, like: Array) -> Array:
    """`x` with its last axis split over the tensor axis of `like`'s mesh, as
    MaxText splits its activations' `embed` axis: under tensor parallelism
    the residual stream between (and saved by) the layers is split, not held
    whole by every device of the axis; else `x` unchanged."""
    mesh = _mesh_of(like)
    if mesh is None or _tensor_size(mesh) <= 1 or not isinstance(x, jax.core.Tracer):
        return x
    spec = PartitionSpec(*[None] * (x.ndim - 1), TENSOR)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


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


def _fsdp_dim(shape: tuple[int, ...], n: int, skip: int | None = None) -> int | None:
    """The largest axis of `shape` but `skip` divisible by `n` (the first among
    equals), or `None` if there is none."""
    best = None
    for i, size in enumerate(shape):
        if i == skip:
            continue
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

    On a mesh with an axis named `"tensor"`, each `zoo.Dense` with `parallel`
    is split over it too (see [`zoo.shard`][]).

    **Returns:**

    A pytree with the structure of `tree`: a `jax.sharding.NamedSharding` in place
    of every array, and the other leaves unchanged.
    """
    n, t = _axis_size("zoo.shard", mesh, axis), _tensor_size(mesh)
    axis = axis if isinstance(axis, str) else tuple(axis)
    if fsdp and t > 1 and TENSOR in ((axis,) if isinstance(axis, str) else axis):
        raise ValueError(
            f"zoo.shard: expected FSDP's axis={axis!r} to leave out the mesh axis "
            f"{TENSOR!r}, which tensor parallelism splits the layers over."
        )

    def leaf_sharding(x, tensor_dim):
        if not is_array_like(x):
            return x
        shape = tuple(x.shape)
        spec: list[Axes | None] = [None] * len(shape)
        if tensor_dim is not None and t > 1:
            tensor_dim %= len(shape)
            if shape[tensor_dim] % t:
                raise ValueError(
                    f"zoo.shard: tensor parallelism over the mesh axis {TENSOR!r} "
                    f"({t} devices) splits axis {tensor_dim} of a Dense layer's "
                    f"array of shape {shape}: expected its size divisible by {t}."
                )
            spec[tensor_dim] = TENSOR
        else:
            tensor_dim = None
        dim = _fsdp_dim(shape, n, tensor_dim) if fsdp else None
        if dim is not None:
            spec[dim] = axis
        return NamedSharding(mesh, PartitionSpec(*spec))

    return _map_dense(leaf_sharding, tree)


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

    **Tensor parallelism.** On a mesh with an axis named `"tensor"` (MaxText's
    `ici_tensor_parallelism`), each `zoo.Dense` with `parallel` is split over
    it as Megatron-LM splits its linear layers: `"columns"` along its output
    axis (the Transformer's q/k/v projection, by whole key/value heads, its
    MLP's first matrices and its output head), `"rows"` along its input axis
    (the attention's and MLP's output projections), and FSDP, with
    `fsdp=True`, along its largest other axis. Inside each layer the weights
    are gathered over every axis but `"tensor"`: each device computes its
    heads and its share of the MLP, and the partial sums of the output
    projections are added across the axis. The batch is not split over it
    (`zoo.shard_batch(tokens, mesh, axis=("data", "fsdp"))`). A layer whose
    split axis the tensor axis does not divide raises a `ValueError`, as does
    a Transformer whose `num_kv_heads` or `d_ff` it does not divide (when it
    is called), and an FSDP `axis` that includes `"tensor"`.

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

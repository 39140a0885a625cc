"""Helpers shared by the inspection functions (`residuals`, `count_flops`,
`memory_report`, `plan`): one way to take their arguments, one way to print bytes
and FLOPs."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree


def is_array_like(x: Any) -> bool:
    """Arrays and `jax.ShapeDtypeStruct`s: the leaves that are traced."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def split_args(args: tuple) -> tuple[PyTree, PyTree]:
    """`(dynamic, static)`: array-like leaves (arrays, `ShapeDtypeStruct`s) are
    dynamic; every other leaf (Python numbers, functions, a module's static
    fields) is static, as in `eqx.filter_jit`."""
    return eqx.partition(args, is_array_like)


def abstract(x: Any, *, keep_sharding: bool = False) -> jax.ShapeDtypeStruct:
    """An array-like leaf as a `jax.ShapeDtypeStruct` (nothing is allocated)."""
    sharding = getattr(x, "sharding", None) if keep_sharding else None
    return jax.ShapeDtypeStruct(
        np.shape(x),
        x.dtype,
        weak_type=getattr(x, "weak_type", False),
        sharding=sharding if isinstance(x, jax.ShapeDtypeStruct) else None,
    )


def traceable(
    fn: Callable[..., Any], args: tuple
) -> tuple[Callable[[PyTree], PyTree], PyTree]:
    """`(f, dynamic)` such that `f(dynamic)` is `fn(*args)` with only the
    array-like leaves of `args` as inputs, every one a `jax.ShapeDtypeStruct`,
    and only the array leaves of the output as outputs. What `residuals`,
    `count_flops` and `memory_report` trace."""
    dynamic, static = split_args(args)

    def f(dynamic):
        out = fn(*eqx.combine(dynamic, static))
        return eqx.filter(out, eqx.is_array)

    return f, jax.tree.map(abstract, dynamic)


def format_bytes(n: int, *, unit: str | None = None, digits: int = 2) -> str:
    """`n` bytes as a short binary-prefixed string.

    **Arguments:**

    - `n`: a number of bytes.
    - `unit`: `"B"`, `"KiB"`, `"MiB"`, `"GiB"` or `"TiB"`; `None` picks the
      largest unit that `n` reaches.
    - `digits`: decimals shown for units above bytes.

    **Returns:**

    A string such as `"1.50 GiB"`, `"80 B"`.
    """
    sizes = {"TiB": 2**40, "GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}
    if unit is None:
        unit = next((u for u, s in sizes.items() if abs(n) >= s), "B")
    if unit == "B":
        return f"{int(n)} B"
    return f"{n / sizes[unit]:.{digits}f} {unit}"


def format_flops(n: int | float) -> str:
    """`n` FLOPs as a short decimal-prefixed string (`k`, `M`, `G`, `T`, `P`): the
    one formatter behind `plan`'s table and the benchmarks' tables.

    **Arguments:**

    - `n`: a number of operations, `>= 0`.

    **Returns:**

    A string with three significant digits above a thousand, such as
    `"1.5 G"` or `"312 T"`; the number itself below, such as `"80"`.
    """
    for unit, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def platform_of(x: Any) -> str:
    """The platform `x` is computed on: that of the mesh `x` is sharded on,
    else of the mesh set with `jax.set_mesh` (one device is enough: e.g.
    `eqx_remat.memory_report(..., target="v5e:1x1")` traces on a one-chip TPU
    mesh), else the default backend's. For code that differs by platform
    while it is traced (zoo's flash attention, a list of layers)."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    for m in (mesh, jax.sharding.get_abstract_mesh()):
        platform = getattr(getattr(m, "abstract_device", None), "platform", None)
        if platform is not None:
            return platform
    return jax.default_backend()

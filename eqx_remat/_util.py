"""Helpers shared by the inspection functions (`residuals`, `count_flops`,
`memory_report`, `plan`): one way to take their arguments, one way to print bytes
and FLOPs, one way to read bytes."""

import re
from collections.abc import Callable
from typing import Any, SupportsIndex

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from ._validate import check_int


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


# Bytes, then decimal units (kb: 10**3, ..., tb: 10**12), then binary (kib: 2**10).
_UNITS = {"": 1, "b": 1} | {
    f"{p}{i}b": (1024 if i else 1000) ** (k + 1)
    for i in ("", "i")
    for k, p in enumerate("kmgt")
}
_BYTES = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_bytes(value: SupportsIndex | str, name: str = "budget_bytes") -> int:
    """A number of bytes from an integer or a string: the parser behind
    [`eqx_remat.plan`][]'s `budget_bytes`, for command lines that take sizes.

    **Arguments:**

    - `value`: an integer `>= 0`, or a string such as `"16GiB"`, `"512 MiB"`,
      `"1.5GB"` or `"4096"` (binary `KiB`/`MiB`/`GiB`/`TiB`, decimal
      `KB`/`MB`/`GB`/`TB`, case-insensitive). A fraction of a unit is
      rounded to the nearest byte; a number of bytes must be whole.
    - `name`: what to call the value in an error message.

    **Returns:**

    The number of bytes, an `int`.

    **Raises:**

    `ValueError` naming `name`, with examples of what is accepted.
    """
    if not isinstance(value, str):
        try:
            return check_int("plan", name, value, 0)
        except ValueError:
            raise ValueError(
                f"{name} must be an int >= 0 or a string such as '16GiB'. "
                f"Got {value!r} of type {type(value).__name__}."
            ) from None
    match = _BYTES.fullmatch(value)
    unit = match and match.group(2).lower()
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{name} must be an int or a string such as '16GiB', '512MiB' or "
            f"'1.5GB' (units: {', '.join(u for u in _UNITS if u)}). Got {value!r}."
        )
    number, factor = float(match.group(1)), _UNITS[unit]
    if factor == 1 and not number.is_integer():
        raise ValueError(f"{name} must be a whole number of bytes. Got {value!r}.")
    size = round(number * factor)
    if size == 0 and number > 0:
        raise ValueError(f"{name} must be 0 or at least one byte. Got {value!r}.")
    return size


def format_size(n: float | int) -> str:
    """A predicted or compiled size: never below zero."""
    return format_bytes(max(int(n), 0))


def format_time(seconds: float) -> str:
    """A step time in s, ms, us or ns, to three digits."""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


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
